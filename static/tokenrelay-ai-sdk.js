// tokenrelay-ai-sdk.js (`tokenrelay-client/ai-sdk`): a ChatTransport for the Vercel AI SDK
// (`ai` >= 5): `useChat({ transport: new TokenRelayChatTransport({ url }), resume: true })`.
// sendMessages() maps UI messages to a `generate` (text; tool calls and results as
// `tool_calls` and `tool` messages) and the stream's events to UIMessageChunks; its
// abortSignal cancels the generation. Each chat's stream id and resume token are kept in a
// store (localStorage in a browser, else memory, or one passed in) until the answer ends, so
// reconnectToStream() after a reload resumes it from seq 0 and the AI SDK rebuilds the
// message from the replay (`resumeStreamIsReplay`). Sockets, resume offsets, dedupe, retries
// and cancel are TokenRelayClient's; this module only maps (frames to chunks in
// client/ai-sdk-chunks.js), and imports nothing from `ai`.
// Reference: docs/client.md ("Vercel AI SDK").

import { RETRYABLE_CODES, TokenRelayClient, TokenRelayError } from "./tokenrelay-client.js";
import { chunks } from "./client/ai-sdk-chunks.js";

/**
 * @typedef {import("ai").UIMessage} UIMessage
 * @typedef {import("ai").UIMessageChunk} UIMessageChunk
 * @typedef {import("./tokenrelay-client.js").ClientOptions} ClientOptions
 * @typedef {import("./tokenrelay-client.js").GenerateParams} GenerateParams
 * @typedef {import("./tokenrelay-client.js").TokenRelayStream} TokenRelayStream
 * @typedef {{id: string, type: "function", function: {name: string, arguments: string}}} ToolCall
 * @typedef {{role: "system"|"user"|"assistant"|"tool", content: string|null,
 *   tool_calls?: ToolCall[], tool_call_id?: string}} RelayMessage
 *   a message of the `generate` frame (docs/protocol.md)
 * @typedef {{streamId: string, resumeToken: string, messageId: string}} StoredStream
 *   what reconnectToStream() needs to resume a chat's answer
 * @typedef {{get: (chatId: string) => StoredStream|null|undefined
 *   |Promise<StoredStream|null|undefined>,
 *   set: (chatId: string, entry: StoredStream) => unknown,
 *   delete: (chatId: string) => unknown}} StreamStore
 *   where the answers in flight are kept, by chat id (a `Map` is one; sync or async)
 * @typedef {object} ChatTransportOptions
 * @property {string} [url] the gateway (`https://host`, `wss://host/v1/ws`, `/`...); default:
 *   the page's origin
 * @property {TokenRelayClient} [client] a client to share (then `url`, `clientOptions` unused)
 * @property {ClientOptions} [clientOptions] for the client made here (`token`, `WebSocket`...)
 * @property {GenerateParams} [params] sampling params of every generate (`max_tokens`,
 *   `temperature`, `tools`...); a request's `body.params` is merged over them
 * @property {StreamStore} [store] default: localStorage in a browser, else a `Map`
 */

/** @template {UIMessage} M @typedef {import("ai").ChatTransport<M>} ChatTransport */

/** Errors after which the stream may still be running (the entry is kept). */
const RETRYABLE = new Set(/** @type {readonly string[]} */ (RETRYABLE_CODES));
/** Errors of a resume that mean nothing is left to resume. */
const GONE = new Set(["not_found", "forbidden", "bad_request"]);

/** @param {string} prefix @returns {string} */
function newId(prefix) {
  const bytes = new Uint8Array(12);
  globalThis.crypto.getRandomValues(bytes);
  return `${prefix}-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/** @param {AbortSignal|undefined} signal @returns {unknown} */
function abortReason(signal) {
  if (signal?.reason !== undefined) return signal.reason;
  const err = new Error("This operation was aborted");
  err.name = "AbortError";
  return err;
}

/**
 * A StreamStore over a Web Storage (`localStorage`, `sessionStorage`): one key per chat,
 * `<prefix><chatId>`, holding JSON. Storage errors (quota, privacy modes) are ignored: the
 * answer then streams, but cannot be resumed after a reload.
 * @param {Storage} storage
 * @param {string} [prefix]
 * @returns {StreamStore}
 */
export function webStorageStore(storage, prefix = "tokenrelay.ai-sdk.v1:") {
  return {
    get(chatId) {
      let entry = null;
      attempt(() => (entry = JSON.parse(storage.getItem(prefix + chatId) ?? "null")));
      return entry;
    },
    set(chatId, entry) {
      attempt(() => storage.setItem(prefix + chatId, JSON.stringify(entry)));
    },
    delete(chatId) {
      attempt(() => storage.removeItem(prefix + chatId));
    },
  };
}

/** @param {() => unknown} fn storage: a failure only costs resuming after a reload */
function attempt(fn) {
  try {
    fn();
  } catch {
    // quota, privacy settings, a bad entry: the answer streams all the same
  }
}

/** @returns {StreamStore} localStorage where a page has one, else memory */
function defaultStore() {
  try {
    const storage = globalThis.window ? globalThis.window.localStorage : undefined;
    if (storage) return webStorageStore(storage);
  } catch {
    // access denied (sandboxed frame, privacy settings): memory
  }
  return new Map();
}

/**
 * The AI SDK's UI messages as the messages of a `generate` frame. Text parts are joined;
 * reasoning, files, sources and data parts are left out (the protocol carries text). An
 * assistant message's tool parts (`tool-<name>`, `dynamic-tool`) with a result become its
 * `tool_calls` followed by one `tool` message per result; each step (`step-start`) of a
 * message is its own assistant turn. Calls still waiting for a result are left out.
 * @param {UIMessage[]} messages
 * @returns {RelayMessage[]}
 */
export function toRelayMessages(messages) {
  /** @type {RelayMessage[]} */
  const out = [];
  for (const message of messages) {
    const parts = /** @type {Record<string, any>[]} */ (message.parts ?? []);
    if (message.role !== "assistant") {
      const text = parts.filter((p) => p.type === "text").map((p) => p.text);
      out.push({ role: message.role, content: text.join("\n") });
      continue;
    }
    let text = "";
    /** @type {ToolCall[]} */
    let calls = [];
    /** @type {RelayMessage[]} */
    let results = [];
    const flush = () => {
      if (calls.length) out.push({ role: "assistant", content: text || null, tool_calls: calls });
      else if (text) out.push({ role: "assistant", content: text });
      out.push(...results);
      text = "";
      calls = [];
      results = [];
    };
    for (const part of parts) {
      if (part.type === "step-start") flush();
      else if (part.type === "text") {
        if (calls.length) flush(); // text after the calls' results: the next turn
        text += part.text;
      } else if (part.type === "dynamic-tool" || part.type.startsWith("tool-")) {
        const content =
          part.state === "output-available"
            ? typeof part.output === "string"
              ? part.output
              : JSON.stringify(part.output ?? null)
            : part.state === "output-error"
              ? String(part.errorText ?? "error")
              : part.state === "output-denied"
                ? "The tool call was denied."
                : null;
        if (content === null) continue; // no result yet
        const name = part.type === "dynamic-tool" ? part.toolName : part.type.slice(5);
        const args = JSON.stringify(part.input ?? {});
        calls.push({ id: part.toolCallId, type: "function", function: { name, arguments: args } });
        results.push({ role: "tool", tool_call_id: part.toolCallId, content });
      }
    }
    flush();
  }
  return out;
}

/**
 * Settles once `relay` is `ready()` (already, or after one of `events`): with true, or with
 * false when it ended before (`relay.error` says why). An aborted `signal` rejects.
 * @param {TokenRelayStream} relay
 * @param {() => boolean} ready
 * @param {string[]} events
 * @param {AbortSignal} [signal]
 * @returns {Promise<boolean>}
 */
function first(relay, ready, events, signal) {
  return new Promise((resolve, reject) => {
    const names = [...events, "done", "error"];
    /** @param {Event} e */
    const on = (e) => settle(() => resolve(events.includes(e.type)));
    const onAbort = () => settle(() => reject(abortReason(signal)));
    /** @param {() => void} then */
    const settle = (then) => {
      for (const name of names) relay.removeEventListener(name, on);
      signal?.removeEventListener("abort", onAbort);
      then();
    };
    if (signal?.aborted) return reject(abortReason(signal));
    if (ready() || relay.closed) return resolve(ready());
    for (const name of names) relay.addEventListener(name, on);
    signal?.addEventListener("abort", onAbort);
  });
}

/**
 * The Vercel AI SDK's ChatTransport over tokenrelay's WebSocket protocol (for chats of any
 * UIMessage type).
 * @implements {ChatTransport<UIMessage>}
 */
export class TokenRelayChatTransport {
  /** @param {ChatTransportOptions} [options] */
  constructor(options = {}) {
    const endpoint = options.url ?? options.clientOptions?.endpoint;
    /** @type {TokenRelayClient} the client carrying the streams (close() it when done) */
    this.client = options.client ?? new TokenRelayClient({ ...options.clientOptions, endpoint });
    /** @type {StreamStore} */
    this.store = options.store ?? defaultStore();
    /** @type {GenerateParams} */
    this.params = options.params ?? {};
    /** @type {true} a reconnected stream replays the answer from its start */
    this.resumeStreamIsReplay = true;
    /** @private @type {Map<string, number>} reconnectToStream() calls, by chat */
    this._reconnects = new Map();
  }

  /**
   * Start the answer to `messages` (a `generate`); resolves once the gateway has started it,
   * with its UIMessageChunks. Rejects with a TokenRelayError when the gateway refuses it, and
   * with the signal's reason when `abortSignal` fires first; `abortSignal` cancels it.
   * @param {{chatId: string, messages: UIMessage[], abortSignal: AbortSignal|undefined,
   *   trigger: "submit-message"|"regenerate-message", messageId: string|undefined,
   *   body?: object, headers?: Record<string, string>|Headers, metadata?: unknown}} options
   *   `body.params` is merged over the transport's `params`; `body.traceparent` passed on
   * @returns {Promise<ReadableStream<UIMessageChunk>>}
   */
  async sendMessages(options) {
    const { chatId, messages, abortSignal } = options;
    /** @type {{params?: GenerateParams, traceparent?: string}} */
    const body = options.body ?? {};
    const last = messages.at(-1);
    // continuing an assistant message (after tool results): the chunks go on into it
    const messageId = last?.role === "assistant" ? last.id : newId("msg");
    const relay = this.client.generate({
      messages: /** @type {any} */ (toRelayMessages(messages)),
      params: { ...this.params, ...body.params },
      ...(body.traceparent ? { traceparent: body.traceparent } : {}),
      signal: abortSignal,
    });
    const stream = chunks(relay, messageId);
    try {
      if (!(await first(relay, () => relay.streamId !== null, ["started"], abortSignal))) {
        throw relay.error ? new TokenRelayError(relay.error, relay) : abortReason(abortSignal);
      }
    } catch (err) {
      relay.cancel();
      stream.cancel().catch(() => {});
      throw err;
    }
    const entry = {
      streamId: /** @type {string} */ (relay.streamId),
      resumeToken: /** @type {string} */ (relay.resumeToken),
      messageId,
    };
    await this.store.set(chatId, entry);
    this._forgetWhenDone(chatId, relay);
    return stream;
  }

  /**
   * The chat's answer in flight, from its first token (after a reload, or a stream left
   * early), or null when it has none: no answer was started, it ended (the entry goes when it
   * does), or the gateway no longer has it. `abortSignal` cancels it, unless another
   * reconnectToStream() for the chat follows at once (a superseded resume).
   * @param {{chatId: string, abortSignal?: AbortSignal, body?: object,
   *   headers?: Record<string, string>|Headers, metadata?: unknown}} options
   * @returns {Promise<ReadableStream<UIMessageChunk>|null>}
   */
  async reconnectToStream(options) {
    const { chatId, abortSignal } = options;
    const call = (this._reconnects.get(chatId) ?? 0) + 1;
    this._reconnects.set(chatId, call);
    const entry = await this.store.get(chatId);
    if (!entry?.streamId || !entry.resumeToken || abortSignal?.aborted) return null;
    const { streamId, resumeToken, messageId } = entry;
    // still tracked by this client (a stream left early, a second resume): its text so far
    // comes first, then what follows
    const tracked = this.client.streams.find((s) => s.streamId === streamId);
    const relay = tracked ?? this.client.resume({ streamId, resumeToken, after: 0 });
    if (!tracked) this._forgetWhenDone(chatId, relay);
    // a stop, or a second resume of the chat at once (React's StrictMode mounts twice)?
    const stop = () => this._reconnects.get(chatId) === call && relay.cancel();
    abortSignal?.addEventListener("abort", () => queueMicrotask(stop), { once: true });
    const stream = chunks(relay, messageId ?? newId("msg"));
    if (tracked) return stream;
    const resumed = () => relay.resumes + relay.lastSeq > 0;
    /** @type {boolean|null} */
    const live = await first(relay, resumed, ["resumed", "token"], abortSignal).catch(() => null);
    if (live === null || (!live && relay.error && GONE.has(relay.error.code))) {
      stream.cancel().catch(() => {}); // aborted, or nothing left to resume
      return null;
    }
    return stream;
  }

  /**
   * Drop the chat's entry once `relay` ends (unless it failed with a retryable error: the
   * answer may still be running) and if it still names this stream.
   * @private @param {string} chatId @param {TokenRelayStream} relay
   */
  _forgetWhenDone(chatId, relay) {
    relay.finished
      .then(async ({ error }) => {
        if (error && RETRYABLE.has(error.code)) return;
        const entry = await this.store.get(chatId);
        if (entry?.streamId === relay.streamId) await this.store.delete(chatId);
      })
      .catch(() => {}); // a store that failed: the entry stays (a later resume says not_found)
  }
}

export default TokenRelayChatTransport;
