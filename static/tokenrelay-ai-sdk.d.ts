// Type declarations for tokenrelay-ai-sdk.js (`tokenrelay-client/ai-sdk`): a ChatTransport
// for the Vercel AI SDK (`ai` >= 5, an optional peer dependency). See docs/client.md.

import type { ChatTransport, UIMessage, UIMessageChunk } from "ai";
import type { ClientOptions, GenerateParams, TokenRelayClient } from "./tokenrelay-client.js";

export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/** A message of the `generate` frame (docs/protocol.md). */
export interface RelayMessage {
  role: "system" | "user" | "assistant" | "tool";
  content: string | null;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
}

/** What reconnectToStream() needs to resume a chat's answer. */
export interface StoredStream {
  streamId: string;
  resumeToken: string;
  messageId: string;
}

/** Where the answers in flight are kept, by chat id: a `Map` is one; sync or async. */
export interface StreamStore {
  get(chatId: string): StoredStream | null | undefined | Promise<StoredStream | null | undefined>;
  set(chatId: string, entry: StoredStream): unknown;
  delete(chatId: string): unknown;
}

export interface ChatTransportOptions {
  /** the gateway (`https://host`, `wss://host/v1/ws`, `/`...); default: the page's origin */
  url?: string;
  /** a client to share (then `url` and `clientOptions` are not used) */
  client?: TokenRelayClient;
  /** for the client made here (`token`, `WebSocket`...) */
  clientOptions?: ClientOptions;
  /** sampling params of every generate; a request's `body.params` is merged over them */
  params?: GenerateParams;
  /** default: localStorage in a browser, else a `Map` */
  store?: StreamStore;
}

type SendOptions = Parameters<ChatTransport<UIMessage>["sendMessages"]>[0];
type ReconnectOptions = Parameters<ChatTransport<UIMessage>["reconnectToStream"]>[0];

/**
 * The Vercel AI SDK's ChatTransport over tokenrelay's WebSocket, for chats of any UIMessage
 * type: `useChat({ transport: new TokenRelayChatTransport({ url }), resume: true })`.
 */
export declare class TokenRelayChatTransport implements ChatTransport<UIMessage> {
  constructor(options?: ChatTransportOptions);
  /** the client carrying the streams (close() it when done) */
  readonly client: TokenRelayClient;
  readonly store: StreamStore;
  readonly params: GenerateParams;
  /** a reconnected stream replays the answer from its start */
  readonly resumeStreamIsReplay: true;
  /**
   * Start the answer (a `generate`); resolves once the gateway has started it. Rejects with
   * a TokenRelayError when the gateway refuses it; `abortSignal` cancels it (stop, not leave).
   * `body.params` is merged over the transport's `params`; `body.traceparent` is passed on.
   */
  sendMessages(options: SendOptions): Promise<ReadableStream<UIMessageChunk>>;
  /**
   * The chat's answer in flight, replayed from its first token, or null when there is none
   * (never started, ended, or no longer kept by the gateway).
   */
  reconnectToStream(options: ReconnectOptions): Promise<ReadableStream<UIMessageChunk> | null>;
}

/** The AI SDK's UI messages as the messages of a `generate` frame. */
export declare function toRelayMessages(messages: UIMessage[]): RelayMessage[];

/** A StreamStore over `localStorage` or `sessionStorage` (one key per chat: prefix + id). */
export declare function webStorageStore(storage: Storage, prefix?: string): StreamStore;

export default TokenRelayChatTransport;
