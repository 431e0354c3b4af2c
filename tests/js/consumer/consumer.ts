// A TypeScript program using tokenrelay-client's public API the way an application would.
// tests/web/test_js_package.py installs the package from its `npm pack` tarball next to this
// file and compiles it with `tsc --strict` (bundler and nodenext resolution); nothing runs.
import TokenRelayClientDefault, {
  type ChatMessage,
  type ClientOptions,
  type ConnectionState,
  DEFAULTS,
  type GenerateRequest,
  RETRYABLE_CODES,
  type StreamResult,
  type ToolCall,
  TokenRelayClient,
  TokenRelayError,
  TokenRelayStream,
  wsTokenFetcher,
} from "tokenrelay-client";
import { type Action, ClientProtocol, type ProtocolStream } from "tokenrelay-client/protocol";
import {
  ATTRIBUTES,
  STRINGS,
  type TokenRelayChatAttributes,
  type TokenRelayChatElement,
  type WidgetStrings,
} from "tokenrelay-client/widget";

const endpoint = "https://chat.example.com";
const options: ClientOptions = {
  endpoint,
  retryLimit: 3,
  retryMaxDelay: 10_000,
  token: wsTokenFetcher(() => sessionStorage.getItem("apiKey"), { endpoint }),
};
const client = new TokenRelayClient(options);
const same: TokenRelayClient = new TokenRelayClientDefault({ endpoint });

client.addEventListener("state", (e) => {
  const state: ConnectionState = e.detail.state;
  const delay: number | undefined = e.detail.delay;
  console.log(state, delay);
});
client.addEventListener("notice", (e) => {
  const drainS: number | null = e.detail.drainS;
  console.log(e.detail.code, drainS);
});

/** Ask one question; Stop is an AbortController. */
export async function ask(question: string, signal?: AbortSignal): Promise<string> {
  const messages: ChatMessage[] = [{ role: "user", content: question }];
  const request: GenerateRequest = {
    messages,
    params: { temperature: 0, max_tokens: 64, stop: "\n\n" },
    signal,
  };
  const stream: TokenRelayStream = client.generate(request);
  stream.addEventListener("token", (e) => {
    const seq: number = e.detail.seq;
    const text: string = e.detail.text;
    console.log(seq, text);
  });
  stream.addEventListener("done", (e) => console.log(e.detail.finishReason, e.detail.usage));
  stream.addEventListener("error", (e) => console.log(e.detail.code, e.detail.retryAfter));
  let out = "";
  try {
    for await (const text of stream) out += text; // text: string
  } catch (err: unknown) {
    if (err instanceof TokenRelayError) {
      const code: string = err.code;
      const retryAfter: number | null = err.retryAfter;
      throw new Error(`${code} (retry in ${retryAfter ?? "?"} s)`);
    }
    if (err instanceof DOMException && err.name === "AbortError") return out;
    throw err;
  }
  const result: StreamResult = await stream.finished;
  const saved: { streamId: string | null; after: number } = stream.toJSON();
  console.log(saved, result.finishReason, result.usage?.completion_tokens);
  return result.text;
}

export async function resumeAfterReload(saved: { streamId: string; resumeToken: string; after: number; text: string }) {
  const stream = client.resume({ ...saved, signal: AbortSignal.timeout(60_000) });
  const chunks: string[] = [];
  for await (const text of stream) chunks.push(text);
  return chunks.join("");
}

const controller = new AbortController();
void ask("Hi", controller.signal);
controller.abort();

const limit: number = DEFAULTS.retryLimit;
const retryable: readonly string[] = RETRYABLE_CODES;
console.log(limit, retryable, same.state, client.stats.retries, client.workerReady);

// @ts-expect-error: a misspelt option is an error
new TokenRelayClient({ retries: 3 });
// @ts-expect-error: streams come from generate() and resume()
new TokenRelayStream();
// @ts-expect-error: a stream's text is read-only
client.generate({ prompt: "x" }).text = "y";

// The sans-I/O state machine, for other transports.
const protocol = new ClientProtocol({ retryLimit: 2 });
const record: ProtocolStream = protocol.generate({ prompt: "Once upon" });
protocol.opened(1);
for (let a: Action | undefined = protocol.nextAction(); a; a = protocol.nextAction()) {
  if (a.type === "send") console.log(a.conn, JSON.stringify(a.frame));
  else if (a.type === "timer") console.log(a.key, a.delay);
}
console.log(record.state);

// A tool round trip on a chosen model: the calls the answer made, then one `tool` message
// answering each of them.
export async function weather(city: string): Promise<string> {
  const tools = [
    {
      type: "function" as const,
      function: { name: "weather", parameters: { type: "object", properties: { city: { type: "string" } } } },
    },
  ];
  const messages: ChatMessage[] = [{ role: "user", content: `Weather in ${city}?` }];
  const first = client.generate({ messages, params: { tools }, model: "qwen2.5-0.5b" });
  const calls: ToolCall[] = await new Promise((resolve) =>
    first.addEventListener("done", (e) => resolve(e.detail.toolCalls ?? [])),
  );
  messages.push({ role: "assistant", content: null, tool_calls: calls });
  for (const call of calls) {
    const args: unknown = JSON.parse(call.function.arguments);
    messages.push({ role: "tool", tool_call_id: call.id, content: JSON.stringify({ args, temp: 21 }) });
  }
  return (await client.generate({ messages, params: { tools }, model: "qwen2.5-0.5b" }).finished).text;
}

// @ts-expect-error: a tool message answers a call by its id
const orphan: ChatMessage = { role: "tool", content: "21" };
// @ts-expect-error: only an assistant message may have no content
const silent: ChatMessage = { role: "user", content: null };
// @ts-expect-error: the model is a name
client.generate({ prompt: "x", model: 7 });
console.log(orphan, silent);

// The widget (loaded by the gateway's /static/widget.js), typed by tokenrelay-client/widget.
const chat: TokenRelayChatElement | null = document.querySelector("tokenrelay-chat");
if (chat) {
  chat.strings = { send: "Senden", stop: "Stopp", openChat: "Chat öffnen: {title}" };
  const sendLabel: string = chat.strings.send;
  chat.setAttribute("model", "qwen2.5-0.5b");
  chat.token = async () => (await (await fetch("/chat-token")).json()).token;
  chat.open = true;
  chat.addEventListener("tokenrelay:done", (e) => {
    const state: "done" | "cancelled" | "error" = e.detail.state;
    console.log(state, e.detail.text, sendLabel);
  });
  chat.addEventListener("tokenrelay:error", (e) => console.log(e.detail.code, e.detail.fatal));
  chat.addEventListener("click", (e) => console.log(e.clientX));
  chat.send("Hi");
  chat.stop();
  console.log(chat.client?.state);
  // @ts-expect-error: not one of the widget's texts
  chat.strings = { sned: "Senden" };
}
const english: WidgetStrings = { ...STRINGS, send: "Envoyer" };
const attributes: TokenRelayChatAttributes = { endpoint: "https://chat.example.com", model: "m" };
// @ts-expect-error: not an attribute of the widget
const typo: TokenRelayChatAttributes = { modle: "m" };
console.log(english, attributes, typo, ATTRIBUTES.includes("model"));
