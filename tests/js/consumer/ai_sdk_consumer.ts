// A TypeScript program using `tokenrelay-client/ai-sdk` with the AI SDK's own types, the way
// an application would (`useChat` takes a ChatTransport; AbstractChat is what it runs).
// tests/web/test_ai_sdk_transport.py installs the package from its `npm pack` tarball next to
// this file, links the pinned `ai` of tests/js, and compiles it with `tsc --strict` (bundler
// and nodenext resolution); nothing runs.
import {
  AbstractChat,
  type ChatInit,
  type ChatState,
  type ChatTransport,
  type UIMessage,
  type UIMessageChunk,
} from "ai";
import { TokenRelayClient } from "tokenrelay-client";
import TokenRelayChatTransportDefault, {
  type ChatTransportOptions,
  type RelayMessage,
  type StoredStream,
  type StreamStore,
  TokenRelayChatTransport,
  toRelayMessages,
  webStorageStore,
} from "tokenrelay-client/ai-sdk";

type Weather = { city: string; temp: number };
type MyMessage = UIMessage<{ createdAt: number }, { weather: Weather }>;

const options: ChatTransportOptions = {
  url: "https://chat.example.com",
  params: { temperature: 0, max_tokens: 256 },
  store: new Map<string, StoredStream>(),
};
const transport = new TokenRelayChatTransport(options);
// what useChat<MyMessage>({ transport }) and useChat({ transport }) take
const typed: ChatTransport<MyMessage> = transport;
const plain: ChatTransport<UIMessage> = new TokenRelayChatTransportDefault({
  client: new TokenRelayClient({ endpoint: "https://chat.example.com" }),
  store: webStorageStore(sessionStorage, "my-app:"),
});
const replay: true = transport.resumeStreamIsReplay;
const client: TokenRelayClient = transport.client;
const store: StreamStore = {
  get: async (chatId) => (chatId ? null : undefined),
  set: async () => {},
  delete: () => undefined,
};
new TokenRelayChatTransport({ store, clientOptions: { retryLimit: 3 } });

class Chat extends AbstractChat<MyMessage> {
  constructor(init: ChatInit<MyMessage>, state: ChatState<MyMessage>) {
    super({ ...init, state });
  }
}
export function chat(state: ChatState<MyMessage>): Chat {
  return new Chat({ id: "c1", transport }, state);
}

export async function firstChunk(chatId: string, signal: AbortSignal): Promise<UIMessageChunk | null> {
  const stream = await transport.reconnectToStream({ chatId, abortSignal: signal });
  if (stream === null) return null;
  const { value } = await stream.getReader().read();
  return value ?? null;
}

export async function send(messages: MyMessage[]): Promise<ReadableStream<UIMessageChunk>> {
  return transport.sendMessages({
    chatId: "c1",
    messages,
    trigger: "submit-message",
    messageId: undefined,
    abortSignal: undefined,
    body: { params: { max_tokens: 32 } },
  });
}

const relay: RelayMessage[] = toRelayMessages([
  { id: "u1", role: "user", parts: [{ type: "text", text: "Hi" }] },
]);
const role: "system" | "user" | "assistant" | "tool" = relay[0].role;

// @ts-expect-error: params are the protocol's (a typo is an error)
new TokenRelayChatTransport({ params: { temprature: 0 } });
// @ts-expect-error: a store needs get, set and delete
new TokenRelayChatTransport({ store: { get: () => null } });

console.log(typed, plain, replay, client, role);
