// Type declarations for tokenrelay-client.js (protocol v1). See docs/client.md.
// Checked against the JSDoc of the .js files by tests/web/test_js_package.py.

import type {
  ChatMessage,
  GenerateParams,
  StreamError,
  StreamState,
  ToolCall,
  ToolCallDelta,
  ToolCallEvent,
  Usage,
} from "./tokenrelay-protocol.js";

export {
  backoffDelay,
  PROTOCOL_VERSION,
  RETRYABLE_CODES,
} from "./tokenrelay-protocol.js";
export type {
  ChatMessage,
  GenerateParams,
  StreamError,
  StreamState,
  ToolCall,
  ToolCallDelta,
  ToolCallEvent,
  Usage,
};

export type ConnectionState = "idle" | "connecting" | "open" | "reconnecting" | "offline" | "closed";
export type FinishReason = "stop" | "length" | "tool_calls" | "cancelled" | "error" | "expired";
export type ErrorCode =
  | "bad_request"
  | "unauthorized"
  | "forbidden"
  | "not_found"
  | "rate_limited"
  | "too_large"
  | "overloaded"
  | "unavailable"
  | "internal";

export interface GenerateRequest {
  messages?: ChatMessage[];
  /** raw text instead of `messages` (skips the chat template) */
  prompt?: string;
  params?: GenerateParams;
  /** one of the gateway's `GET /v1/models`; left out: the gateway's default model */
  model?: string;
  /** defaults to a random id */
  requestId?: string;
  /**
   * Aborting it cancels the stream (nothing is sent at all if it had already aborted) and
   * makes iterating the stream throw the signal's reason (an AbortError).
   */
  signal?: AbortSignal;
}

export interface ResumeRequest {
  streamId: string;
  resumeToken: string;
  /** seq of the last event already held (0: from the start) */
  after?: number;
  /** the text already held up to `after` */
  text?: string;
  /** the calls already held up to `after` (`toJSON()` gives them; later fragments add to them) */
  toolCalls?: ToolCall[];
  /** aborting it cancels the stream */
  signal?: AbortSignal;
}

export interface StreamResult {
  text: string;
  finishReason: FinishReason | string | null;
  usage: Usage | null;
  error: StreamError | null;
}

export interface ClientStats {
  connects: number;
  reconnects: number;
  resumes: number;
  drops: number;
  heartbeatTimeouts: number;
  duplicates: number;
  gaps: number;
  /** generates and resumes sent again after a retryable error */
  retries: number;
}

export interface ClientOptions {
  /** gateway URL (`https://host`, `wss://host/v1/ws`, `/`); default: the page's origin */
  endpoint?: string;
  heartbeatInterval?: number;
  heartbeatTimeout?: number;
  connectTimeout?: number;
  backoffInitial?: number;
  backoffMax?: number;
  backoffFactor?: number;
  backoffJitter?: number;
  /** failed connection attempts in a row before giving up (default Infinity) */
  maxRetries?: number;
  /**
   * Times a generate (or resume) refused with `unavailable`, `overloaded` or `rate_limited`
   * is sent again, after `retry_after` plus the jittered backoff (default 8; 0: never).
   */
  retryLimit?: number;
  /** ms: a `retry_after` longer than this fails the stream at once (default 30000) */
  retryMaxDelay?: number;
  cancelTimeout?: number;
  autoConnect?: boolean;
  /**
   * For a gateway with API keys: a short-lived token from `POST /v1/ws-token` (sent as
   * `?token=`), or a function called before every (re)connect that returns one (see
   * `wsTokenFetcher`). Never a long-lived API key: URLs end up in logs.
   */
  token?: string | null | (() => string | null | Promise<string | null>);
  WebSocket?: typeof WebSocket;
  window?: Pick<EventTarget, "addEventListener" | "removeEventListener"> | null;
  navigator?: { onLine?: boolean } | null;
  random?: () => number;
  timers?: {
    setTimeout: (fn: () => void, ms: number) => unknown;
    clearTimeout: (id: unknown) => void;
  };
}

export declare const DEFAULTS: Readonly<
  Required<
    Pick<
      ClientOptions,
      | "heartbeatInterval"
      | "heartbeatTimeout"
      | "connectTimeout"
      | "backoffInitial"
      | "backoffMax"
      | "backoffFactor"
      | "backoffJitter"
      | "maxRetries"
      | "retryLimit"
      | "retryMaxDelay"
      | "cancelTimeout"
      | "autoConnect"
    >
  >
>;

/**
 * What iterating a stream throws when the stream fails: `code` is the protocol's error code,
 * `retryAfter` the seconds the server asked to wait (rate_limited, overloaded) or null.
 */
export declare class TokenRelayError extends Error {
  constructor(error: StreamError, where?: { streamId?: string | null; requestId?: string | null });
  readonly code: ErrorCode | string;
  readonly retryAfter: number | null;
  readonly streamId: string | null;
  readonly requestId: string | null;
}

/**
 * A `token` option: trades an API key for a short-lived WebSocket token
 * (`POST /v1/ws-token`) before every connect; null when the gateway needs no key.
 * Rejects with an Error whose `code` is "unauthorized" for a missing or wrong key.
 */
export declare function wsTokenFetcher(
  apiKey: string | null | (() => string | null | Promise<string | null>),
  options?: { endpoint?: string; fetch?: typeof fetch },
): () => Promise<string | null>;

export declare function resolveEndpoint(endpoint: string | undefined | null, base?: string): string;

export interface StreamEventMap {
  started: CustomEvent<{ streamId: string; resumeToken: string; promptTokens: number | null }>;
  token: CustomEvent<{
    seq: number;
    text: string;
    fullText: string;
    /** the frame's `logprobs` (docs/protocol.md, `token`): only when `params.logprobs` was set */
    logprobs?: {
      token: string;
      logprob: number;
      bytes: number[];
      top_logprobs: { token: string; logprob: number; bytes: number[] }[];
    }[];
    /** the frame's `tool_calls` deltas (with `params.tools`; a `tool-call` event follows each) */
    toolCalls?: ToolCallDelta[];
  }>;
  /** One per delta of a call, after its `token` event: the call so far (docs/client.md). */
  "tool-call": CustomEvent<ToolCallEvent>;
  resumed: CustomEvent<{ after: number }>;
  done: CustomEvent<{
    finishReason: FinishReason | string;
    usage: Usage | null;
    text: string;
    seq: number;
    /** true when the client ended the stream itself (cancel with no server answer) */
    local?: boolean;
    message?: string;
    /** the calls the answer made (`finishReason` "tool_calls"; docs/protocol.md, `done`) */
    toolCalls?: ToolCall[];
  }>;
  error: CustomEvent<{ code: ErrorCode | string; message: string; retryAfter?: number }>;
  "cancel-ack": CustomEvent<{ state: "cancelling" | "finished"; finishReason: string | null }>;
}

/**
 * One response stream: an EventTarget (events in StreamEventMap) and an async iterable of the
 * text of its tokens. `for await (const text of stream)` yields every chunk from the first,
 * ends after `done`, throws a TokenRelayError after `error` and the signal's reason once the
 * request's `signal` aborts; leaving the loop early (`break`) cancels the stream.
 */
export declare class TokenRelayStream extends EventTarget implements AsyncIterable<string> {
  /** streams come from TokenRelayClient.generate() and resume() */
  private constructor();
  readonly requestId: string | null;
  readonly streamId: string | null;
  readonly resumeToken: string | null;
  /** seq of the last event delivered */
  readonly lastSeq: number;
  /** all text delivered so far */
  readonly text: string;
  /** with `params.tools`: the calls so far (arguments as far as they came), in index order;
   * the `done` frame's list once done */
  readonly toolCalls: ToolCall[];
  readonly state: StreamState;
  readonly promptTokens: number | null;
  readonly finishReason: string | null;
  readonly usage: Usage | null;
  readonly error: StreamError | null;
  readonly resumes: number;
  readonly cancelRequested: boolean;
  readonly closed: boolean;
  /** settles when the stream ends; never rejects */
  readonly finished: Promise<StreamResult>;
  cancel(): void;
  /** what `resume()` takes to go on later (`toolCalls` only when calls were begun) */
  toJSON(): {
    streamId: string | null;
    resumeToken: string | null;
    after: number;
    text: string;
    toolCalls?: ToolCall[];
  };
  [Symbol.asyncIterator](): AsyncIterableIterator<string>;
  addEventListener<K extends keyof StreamEventMap>(
    type: K,
    listener: (ev: StreamEventMap[K]) => void,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(
    type: string,
    listener: EventListenerOrEventListenerObject | null,
    options?: boolean | AddEventListenerOptions,
  ): void;
}

export interface ClientEventMap {
  state: CustomEvent<{
    state: ConnectionState;
    previous: ConnectionState;
    attempt: number;
    delay?: number;
    code?: string;
    message?: string;
  }>;
  open: CustomEvent<{ hello: Record<string, unknown> }>;
  /** An engine worker became ready, after a hello that said none was. */
  readiness: CustomEvent<{ ready: boolean }>;
  /** Information from the gateway, e.g. `shutting_down` while it drains (see docs/protocol.md). */
  notice: CustomEvent<{ code: string; message: string; drainS: number | null }>;
  resumed: CustomEvent<{ stream: TokenRelayStream; after: number }>;
  "heartbeat-timeout": CustomEvent<Record<string, never>>;
  error: CustomEvent<{ code: string; message: string; frame: Record<string, unknown> }>;
  frame: CustomEvent<{ frame: Record<string, unknown> }>;
}

export declare class TokenRelayClient extends EventTarget {
  constructor(options?: ClientOptions);
  readonly url: string;
  readonly options: Readonly<ClientOptions & typeof DEFAULTS>;
  readonly state: ConnectionState;
  readonly streams: TokenRelayStream[];
  readonly hello: Record<string, unknown> | null;
  /** Whether an engine worker is ready to take a generate (from the gateway's hello/notices). */
  readonly workerReady: boolean;
  readonly stats: ClientStats;
  connect(): void;
  close(): void;
  /** QA: drop the socket as a network failure would; reconnects and resumes */
  dropConnection(): void;
  generate(request: GenerateRequest): TokenRelayStream;
  resume(request: ResumeRequest): TokenRelayStream;
  addEventListener<K extends keyof ClientEventMap>(
    type: K,
    listener: (ev: ClientEventMap[K]) => void,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(
    type: string,
    listener: EventListenerOrEventListenerObject | null,
    options?: boolean | AddEventListenerOptions,
  ): void;
}

export default TokenRelayClient;
