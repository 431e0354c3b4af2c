// Scenarios for static/tokenrelay-ai-sdk.js (TokenRelayChatTransport) with the pinned `ai`
// package of tests/js, shared by Node (tests/js/ai_sdk.mjs) and Chromium (a page bundling
// this file with `ai`, tests/web/test_ai_sdk_transport.py). The chats are the AI SDK's own
// AbstractChat (what `useChat` runs) over a plain ChatState, so no React is needed. Each
// scenario returns plain data; the Python tests compare the text with the gateway's greedy
// answers and check on the gateway what a cancel did.

/** A ChatState in plain objects (what @ai-sdk/react keeps in React state). */
class PlainState {
  constructor(watch = () => {}) {
    this.status = "ready";
    this.error = undefined;
    this.messages = [];
    this.watch = watch; // called with each message the chat writes
  }
  pushMessage(m) {
    this.watch(m);
    this.messages = [...this.messages, m];
  }
  popMessage() {
    this.messages = this.messages.slice(0, -1);
  }
  replaceMessage(i, m) {
    this.watch(m);
    this.messages = [...this.messages.slice(0, i), m, ...this.messages.slice(i + 1)];
  }
  snapshot(x) {
    return structuredClone(x);
  }
}

/** An AbstractChat of `ai` over PlainState; `finishes` records each onFinish. */
export function makeChat(AbstractChat, init, watch = undefined) {
  const finishes = [];
  class Chat extends AbstractChat {
    constructor() {
      super({
        ...init,
        state: new PlainState(watch),
        onFinish: (e) => finishes.push({ isAbort: e.isAbort, isError: e.isError, finishReason: e.finishReason ?? null }),
      });
    }
  }
  const chat = new Chat();
  chat.finishes = finishes;
  return chat;
}

/** The text of the chat's last assistant message. */
export function answer(chat) {
  const last = chat.messages.findLast((m) => m.role === "assistant");
  return last ? last.parts.filter((p) => p.type === "text").map((p) => p.text).join("") : null;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Wait until `check()` is truthy (every 20 ms, at most `ms`). */
export async function until(check, ms = 120_000, what = "a condition") {
  const end = Date.now() + ms;
  while (!check()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

/** A Map store that remembers every entry set (the abort check reads the stream's ids). */
export class RecordingStore extends Map {
  constructor() {
    super();
    this.log = [];
  }
  set(key, value) {
    this.log.push({ chatId: key, ...value });
    return super.set(key, value);
  }
}

/**
 * A transport class whose sendMessages() also records the types of the chunks it hands out,
 * and those that `ai`'s own uiMessageChunkSchema refuses.
 */
export function recording(Transport, chunkSchema) {
  const schema = chunkSchema();
  return class extends Transport {
    constructor(options) {
      super(options);
      this.chunkTypes = [];
      this.invalidChunks = [];
    }
    async sendMessages(options) {
      const [mine, copy] = (await super.sendMessages(options)).tee();
      (async () => {
        for await (const chunk of copy) {
          this.chunkTypes.push(chunk.type);
          if (!(await schema.validate(chunk)).success) this.invalidChunks.push(chunk);
        }
      })();
      return mine;
    }
  };
}

/**
 * Node: a two-turn chat (the second turn sends the first answer back as history), Stop
 * during a long answer, a "reload" (the first transport's client closes mid-answer; a new
 * transport on the same store resumes the chat), and reconnects that must give null.
 * A tool call streams into the chat's tool part (input-streaming, then input-available).
 * cfg: {url, params, question, followUp, long: {question, params}, tools: {question, params},
 * clientOptions?}
 */
export async function runNodeChecks({ TokenRelayChatTransport, AbstractChat, uiMessageChunkSchema }, cfg) {
  const Recording = recording(TokenRelayChatTransport, uiMessageChunkSchema);
  const out = {};
  const base = { url: cfg.url, params: cfg.params, clientOptions: cfg.clientOptions };

  // --- a chat, two turns ---
  const store = new RecordingStore();
  const t1 = new Recording({ ...base, store });
  const chat = makeChat(AbstractChat, { id: "chat-turns", transport: t1 });
  await chat.sendMessage({ text: cfg.question });
  const first = answer(chat);
  const chunkTypes = [...t1.chunkTypes];
  const storedWhileStreaming = store.log.length;
  await chat.sendMessage({ text: cfg.followUp });
  out.chat = {
    first,
    second: answer(chat),
    roles: chat.messages.map((m) => m.role),
    status: chat.status,
    error: chat.error?.message ?? null,
    finishes: chat.finishes,
    chunkTypes,
    invalidChunks: t1.invalidChunks,
    storedWhileStreaming,
    storeAfter: store.size,
    reconnect: (await t1.reconnectToStream({ chatId: "chat-turns" })) === null ? null : "a stream",
  };

  // --- a tool call: the AI SDK's tool part streams its input, then has it whole ---
  const t4 = new Recording({ ...base, store: new Map() });
  const seen = []; // the tool part as each write of the message left it
  const watch = (m) => {
    const part = m.parts?.find((p) => p.type.startsWith("tool-"));
    if (part) seen.push({ state: part.state, input: structuredClone(part.input ?? null) });
  };
  const calling = makeChat(AbstractChat, { id: "chat-tools", transport: t4 }, watch);
  await calling.sendMessage({ text: cfg.tools.question }, { body: { params: cfg.tools.params } });
  await until(() => t4.chunkTypes.includes("finish"), 10_000, "the chunks to be read");
  const last = calling.messages.at(-1);
  const part = last.parts.find((p) => p.type.startsWith("tool-"));
  out.tools = {
    chunkTypes: t4.chunkTypes,
    invalidChunks: t4.invalidChunks,
    part: part ? { type: part.type, state: part.state, input: part.input, toolCallId: part.toolCallId } : null,
    seen,
    status: calling.status,
    error: calling.error?.message ?? null,
    finishes: calling.finishes,
  };

  // --- Stop during a long answer: the AI SDK aborts, the transport cancels ---
  const stopStore = new RecordingStore();
  const t2 = new TokenRelayChatTransport({ ...base, store: stopStore });
  const stopped = makeChat(AbstractChat, { id: "chat-stop", transport: t2 });
  const sending = stopped.sendMessage({ text: cfg.long.question }, { body: { params: cfg.long.params } });
  await until(() => (answer(stopped) ?? "").length >= 8, 120_000, "the first tokens");
  const partial = answer(stopped);
  await stopped.stop();
  await sending;
  const entry = stopStore.log[0];
  await until(() => !stopStore.has("chat-stop"), 30_000, "the cancelled stream to end");
  out.stop = {
    partial,
    status: stopped.status,
    finishes: stopped.finishes,
    streamId: entry.streamId,
    resumeToken: entry.resumeToken,
    reconnect: (await t2.reconnectToStream({ chatId: "chat-stop" })) === null ? null : "a stream",
  };

  // --- a reload mid-answer: the socket goes, a new transport resumes the chat ---
  const shared = new RecordingStore();
  const before = new TokenRelayChatTransport({ ...base, store: shared });
  const gone = makeChat(AbstractChat, { id: "chat-reload", transport: before });
  gone.sendMessage({ text: cfg.long.question }, { body: { params: cfg.long.params } });
  await until(() => (answer(gone) ?? "").length >= 8, 120_000, "the first tokens");
  const partialBefore = answer(gone);
  before.client.close(); // the page goes: its socket closes, no cancel
  const after = new TokenRelayChatTransport({ ...base, store: shared });
  const back = makeChat(AbstractChat, { id: "chat-reload", transport: after });
  await back.resumeStream();
  const replayed = answer(back);
  const messagesAfterResume = back.messages.length;
  await back.resumeStream(); // finished: reconnectToStream gives null, nothing changes
  out.reload = {
    partialBefore,
    text: replayed,
    messageId: back.messages[0]?.id ?? null,
    storedMessageId: shared.log[0]?.messageId ?? null,
    messages: messagesAfterResume,
    messagesAfterSecondResume: back.messages.length,
    status: back.status,
    error: back.error?.message ?? null,
    finishes: back.finishes,
    storeAfter: shared.size,
    reconnect: (await after.reconnectToStream({ chatId: "chat-reload" })) === null ? null : "a stream",
  };

  // --- nothing to resume: an unknown chat, and an entry the gateway does not know ---
  const bogus = new Map([
    ["chat-bogus", { streamId: "AAAAAAAAAAAAAAAAAAAAAA", resumeToken: "x".repeat(43), messageId: "m1" }],
  ]);
  const t3 = new TokenRelayChatTransport({ ...base, store: bogus });
  out.none = {
    unknown: (await t3.reconnectToStream({ chatId: "chat-unknown" })) === null ? null : "a stream",
    notFound: (await t3.reconnectToStream({ chatId: "chat-bogus" })) === null ? null : "a stream",
  };
  await until(() => !bogus.has("chat-bogus"), 10_000, "the unknown stream's entry to go");
  out.none.entryCleared = true;

  for (const t of [t1, t2, t4, before, after, t3]) t.client.close();
  return out;
}

/** Chromium, first page load: a chat streams a short answer, then starts a long one. */
export async function pageStart({ TokenRelayChatTransport, AbstractChat }, cfg) {
  const transport = new TokenRelayChatTransport({ url: cfg.url, params: cfg.params });
  const chat = makeChat(AbstractChat, { id: "page-chat", transport });
  await chat.sendMessage({ text: cfg.question });
  const short = { text: answer(chat), status: chat.status, finishes: [...chat.finishes] };
  const long = makeChat(AbstractChat, { id: "page-reload", transport });
  long.sendMessage({ text: cfg.long.question }, { body: { params: cfg.long.params } });
  await until(() => (answer(long) ?? "").length >= 8, 120_000, "the first tokens");
  return { short, partial: answer(long), stored: localStorage.getItem("tokenrelay.ai-sdk.v1:page-reload") };
}

/** Chromium, after the reload: `useChat({resume: true})` resumes the long answer. */
export async function pageResume({ TokenRelayChatTransport, AbstractChat }, cfg) {
  const transport = new TokenRelayChatTransport({ url: cfg.url, params: cfg.params });
  const chat = makeChat(AbstractChat, { id: "page-reload", transport });
  const stored = localStorage.getItem("tokenrelay.ai-sdk.v1:page-reload");
  await chat.resumeStream();
  const out = {
    stored,
    text: answer(chat),
    messages: chat.messages.length,
    status: chat.status,
    error: chat.error?.message ?? null,
    finishes: [...chat.finishes],
  };
  await until(() => localStorage.getItem("tokenrelay.ai-sdk.v1:page-reload") === null, 10_000, "the entry to go");
  const again = makeChat(AbstractChat, { id: "page-reload", transport });
  await again.resumeStream();
  out.afterFinish = { messages: again.messages.length, status: again.status };
  out.reconnect = (await transport.reconnectToStream({ chatId: "page-reload" })) === null ? null : "a stream";
  transport.client.close();
  return out;
}
