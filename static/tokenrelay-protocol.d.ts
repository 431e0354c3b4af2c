// Type declarations for tokenrelay-protocol.js: the client side of protocol v1, sans I/O.
// See docs/client.md ("The protocol state machine") and docs/protocol.md.

export declare const PROTOCOL_VERSION: 1;

/** Error codes after which a generate (or a resume) is sent again, with backoff. */
export declare const RETRYABLE_CODES: readonly ["unavailable", "overloaded", "rate_limited"];

export type StreamState = "pending" | "streaming" | "done" | "error";

/** A call an answer made (the `done` frame's `tool_calls`); `arguments` is a JSON string. */
export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/**
 * One entry of a `token` frame's `tool_calls` (OpenAI's `delta.tool_calls`): a call's first
 * entry has its `id`, `type` and `name`; each entry an `arguments` fragment. A call's
 * fragments, in seq order, add up to its `arguments`.
 */
export interface ToolCallDelta {
  index: number;
  id?: string;
  type?: "function";
  function: { name?: string; arguments: string };
}

/**
 * The `tool-call` stream event, one per delta: the call's `id` and `name`, whether this is
 * its `first` entry, the fragment (`argumentsDelta`) and its `arguments` so far.
 */
export interface ToolCallEvent {
  seq: number;
  index: number;
  id: string;
  name: string;
  first: boolean;
  argumentsDelta: string;
  arguments: string;
}

/**
 * A message of the `generate` frame (docs/protocol.md). A tool round trip: the assistant
 * message that made the calls (with `tool_calls`, `content` then may be null), then one
 * `tool` message per call, answering it by its `tool_call_id`.
 */
export type ChatMessage =
  | { role: "system" | "user"; content: string }
  | { role: "assistant"; content?: string | null; tool_calls?: ToolCall[] }
  | { role: "tool"; content: string; tool_call_id: string };

export interface GenerateParams {
  max_tokens?: number;
  /** 0 = greedy */
  temperature?: number;
  top_p?: number;
  top_k?: number;
  seed?: number;
  /** up to 16 stop strings, or one */
  stop?: string | string[];
  ignore_eos?: boolean;
  /** drop tokens less likely than `min_p` times the most likely one */
  min_p?: number;
  /** −2 to 2 (OpenAI's) */
  presence_penalty?: number;
  /** −2 to 2 (OpenAI's) */
  frequency_penalty?: number;
  /** > 0 (vLLM's) */
  repetition_penalty?: number;
  /** token id (decimal string) → −100 to 100, at most 300 entries */
  logit_bias?: Record<string, number>;
  /** at most 64 token ids that end the completion */
  stop_token_ids?: number[];
  /** 0–20: each `token` event carries `logprobs` with that many alternatives */
  logprobs?: number | null;
  /** structured outputs (docs/api.md): `{type: "json_object"}` or
   * `{type: "json_schema", json_schema: {name, schema}}`; not with `ignore_eos` */
  response_format?:
    | { type: "text" | "json_object" }
    | {
        type: "json_schema";
        json_schema: {
          name?: string;
          schema: Record<string, unknown>;
          strict?: boolean | null;
          description?: string;
        };
      }
    | null;
  /** OpenAI's function tools (docs/api.md, "Tool calls"); `done` then has `toolCalls` */
  tools?: {
    type: "function";
    function: {
      name: string;
      description?: string;
      parameters?: Record<string, unknown>;
      strict?: boolean;
    };
  }[];
  tool_choice?: "none" | "auto" | "required" | { type: "function"; function: { name: string } };
  parallel_tool_calls?: boolean;
  /** choices: 1 only with this client (one stream per generate()) */
  n?: 1;
  /** seconds the stream keeps generating with no client attached, so that it can be resumed
   * (above 0, at most the gateway's `max_detach_timeout`, which its hello gives); left out:
   * the gateway's `detach_timeout` (30 s by default) */
  detach_timeout?: number;
}

export interface GenerateRequest {
  messages?: ChatMessage[];
  /** raw text instead of `messages` (skips the chat template) */
  prompt?: string;
  params?: GenerateParams;
  /** one of the gateway's `GET /v1/models`; left out: the gateway's default model */
  model?: string;
  /** defaults to a random id */
  requestId?: string;
  /** a W3C trace context (`00-<trace id>-<span id>-<flags>`): the request joins that trace */
  traceparent?: string;
}

export interface ResumeRequest {
  streamId: string;
  resumeToken: string;
  /** seq of the last event already held (0: from the start) */
  after?: number;
  /** the text already held up to `after` */
  text?: string;
  /** the calls already held up to `after` (the fragments that follow add to them) */
  toolCalls?: ToolCall[];
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
}

export interface StreamError {
  code: string;
  message: string;
  /** seconds, from the error frame's `retry_after` (rate_limited, overloaded) */
  retryAfter?: number;
}

export interface ProtocolStats {
  resumes: number;
  duplicates: number;
  gaps: number;
  retries: number;
}

export type StreamEventName =
  | "started"
  | "token"
  | "tool-call"
  | "resumed"
  | "done"
  | "error"
  | "cancel-ack";
export type ClientEventName = "open" | "readiness" | "notice" | "error";

/** What the I/O layer must do, in the order given (see ClientProtocol). */
export type Action =
  | { type: "send"; conn: number; frame: Record<string, unknown> }
  | {
      type: "stream";
      stream: ProtocolStream;
      name: StreamEventName;
      detail: Record<string, unknown>;
    }
  | { type: "client"; name: ClientEventName; detail: Record<string, unknown> }
  | { type: "timer"; key: string; delay: number }
  | { type: "clear-timer"; key: string }
  | { type: "drain"; conn: number; drainS: number | null };

export interface ProtocolOptions {
  /** ms to wait for the server's `done` after cancel() before ending locally (0: for ever) */
  cancelTimeout?: number;
  /** retries of a generate or resume refused with a retryable code (0: none) */
  retryLimit?: number;
  /** ms: a longer `retry_after` fails the stream at once */
  retryMaxDelay?: number;
  backoffInitial?: number;
  backoffMax?: number;
  backoffFactor?: number;
  backoffJitter?: number;
  random?: () => number;
  /** counters to update (default: a new object) */
  stats?: ProtocolStats;
}

export declare const PROTOCOL_DEFAULTS: Readonly<
  Required<Omit<ProtocolOptions, "random" | "stats">>
>;

type BackoffOptions = Pick<
  ProtocolOptions,
  "backoffInitial" | "backoffMax" | "backoffFactor" | "backoffJitter"
>;

/** Delay (ms) before attempt `attempt` (0 = the first): capped exponential backoff, jittered. */
export declare function backoffDelay(
  attempt: number,
  options?: BackoffOptions,
  random?: () => number,
): number;

/** Delay (ms) before retry `attempt` (1 = the first): `retry_after` (s) plus the backoff. */
export declare function retryDelay(
  attempt: number,
  retryAfter: number | null | undefined,
  options?: BackoffOptions,
  random?: () => number,
): number;

/** The protocol's record of one stream (read it; only ClientProtocol changes it). */
export declare class ProtocolStream {
  private constructor();
  readonly id: number;
  readonly requestId: string | null;
  readonly streamId: string | null;
  readonly resumeToken: string | null;
  readonly lastSeq: number;
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
  /** the generate frame (null for a resumed stream) */
  readonly frame: Record<string, unknown> | null;
  readonly everSent: boolean;
  /** the connection the stream is attached to */
  readonly conn: number | null;
  readonly resyncing: boolean;
  readonly retries: number;
  readonly waiting: boolean;
  readonly cancelTimer: boolean;
  readonly closed: boolean;
}

/**
 * The client side of protocol v1 over any number of connections (numbers the caller picks).
 * Inputs: generate/resume/cancel, opened/closed, receive, timer. Output: nextAction().
 */
export declare class ClientProtocol {
  constructor(options?: ProtocolOptions);
  readonly options: Required<Omit<ProtocolOptions, "random" | "stats">>;
  readonly stats: ProtocolStats;
  /** the last `hello` frame */
  readonly hello: Record<string, unknown> | null;
  readonly workerReady: boolean;
  /** the streams not yet finished */
  readonly streams: ProtocolStream[];
  /** the connection new frames go to (null: none is open) */
  readonly primary: number | null;
  nextAction(): Action | undefined;
  takeActions(): Action[];
  draining(conn: number): boolean;
  stream(streamId: string): ProtocolStream | undefined;
  generate(request: GenerateRequest, how?: { cancelled?: boolean }): ProtocolStream;
  resume(request: ResumeRequest): ProtocolStream;
  cancel(stream: ProtocolStream): void;
  pause(): void;
  fail(code: string, message: string): void;
  opened(conn: number): void;
  closed(conn: number): void;
  timer(key: string): void;
  receive(conn: number, frame: Record<string, any>): void;
}
