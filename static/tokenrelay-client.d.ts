// Type declarations for tokenrelay-client.js (protocol v1). See docs/client.md.

export declare const PROTOCOL_VERSION: 1;

export type ConnectionState = "idle" | "connecting" | "open" | "reconnecting" | "offline" | "closed";
export type StreamState = "pending" | "streaming" | "done" | "error";
export type FinishReason = "stop" | "length" | "cancelled" | "error" | "expired";
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

export interface ChatMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

export interface GenerateParams {
  max_tokens?: number;
  /** 0 = greedy */
  temperature?: number;
  top_p?: number;
  top_k?: number;
  seed?: number;
  stop?: string[];
  ignore_eos?: boolean;
}

export interface GenerateRequest {
  messages?: ChatMessage[];
  /** raw text instead of `messages` (skips the chat template) */
  prompt?: string;
  params?: GenerateParams;
  /** defaults to a random id */
  requestId?: string;
}

export interface ResumeRequest {
  streamId: string;
  resumeToken: string;
  /** seq of the last event already held (0: from the start) */
  after?: number;
  /** the text already held up to `after` */
  text?: string;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
}

export interface StreamResult {
  text: string;
  finishReason: FinishReason | string | null;
  usage: Usage | null;
  error: { code: ErrorCode | string; message: string } | null;
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
  maxRetries?: number;
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
      | "cancelTimeout"
      | "autoConnect"
    >
  >
>;

export declare function backoffDelay(
  attempt: number,
  options?: Pick<ClientOptions, "backoffInitial" | "backoffMax" | "backoffFactor" | "backoffJitter">,
  random?: () => number,
): number;

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
  token: CustomEvent<{ seq: number; text: string; fullText: string }>;
  resumed: CustomEvent<{ after: number }>;
  done: CustomEvent<{
    finishReason: FinishReason | string;
    usage: Usage | null;
    text: string;
    seq: number;
    /** true when the client ended the stream itself (cancel with no server answer) */
    local?: boolean;
    message?: string;
  }>;
  error: CustomEvent<{ code: ErrorCode | string; message: string }>;
  "cancel-ack": CustomEvent<{ state: "cancelling" | "finished"; finishReason: string | null }>;
}

export declare class TokenRelayStream extends EventTarget {
  readonly requestId: string | null;
  readonly streamId: string | null;
  readonly resumeToken: string | null;
  /** seq of the last event delivered */
  readonly lastSeq: number;
  /** all text delivered so far */
  readonly text: string;
  readonly state: StreamState;
  readonly promptTokens: number | null;
  readonly finishReason: string | null;
  readonly usage: Usage | null;
  readonly error: { code: string; message: string } | null;
  readonly resumes: number;
  readonly cancelRequested: boolean;
  readonly closed: boolean;
  /** settles when the stream ends; never rejects */
  readonly finished: Promise<StreamResult>;
  cancel(): void;
  toJSON(): { streamId: string | null; resumeToken: string | null; after: number; text: string };
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
  readonly stats: {
    connects: number;
    reconnects: number;
    resumes: number;
    drops: number;
    heartbeatTimeouts: number;
    duplicates: number;
    gaps: number;
  };
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
