// tokenrelay-protocol.js: the client side of tokenrelay's WebSocket protocol v1, sans I/O.
//
// A state machine: user calls (generate, resume, cancel), connection events (opened, closed),
// received frames and timer expirations go in; actions come out: frames to send on a given
// connection, events for a stream or for the client, timers to set or clear, and "this
// connection drains, open the next one". It opens no socket and sets no timer:
// tokenrelay-client.js does that around it, as gateway/ws/connection.py does around
// gateway/session/protocol.py. What it owns is what makes streamed text exactly-once: per-stream
// seq bookkeeping (drop repeats, replay from the last seq on a gap), resume offsets, cancel,
// and which refusals are retried, when, and how often.
//
//   const p = new ClientProtocol();
//   const s = p.generate({messages: [{role: "user", content: "Hi"}]});
//   p.opened(1);                         // a socket (id 1) is open
//   p.receive(1, JSON.parse(data));      // every frame received on it
//   for (let a; (a = p.nextAction()); ) perform(a);   // send, emit, set timers...
//
// This file is the public entry (`tokenrelay-client/protocol` in the npm package): the
// protocol's types (JSDoc, mirrored by tokenrelay-protocol.d.ts) and its exports. The code is
// in client/: protocol.js (ClientProtocol: the inputs), protocol-state.js (the streams,
// connections and actions it keeps), protocol-stream.js (ProtocolStream) and retry.js (which
// refusals are retried, and the backoff).
//
// Reference: docs/client.md (the client) and docs/protocol.md (the wire protocol).

import { ClientProtocol } from "./client/protocol.js";
import { ProtocolStream } from "./client/protocol-stream.js";
import { backoffDelay, PROTOCOL_DEFAULTS, RETRYABLE_CODES, retryDelay } from "./client/retry.js";

export {
  backoffDelay,
  ClientProtocol,
  PROTOCOL_DEFAULTS,
  ProtocolStream,
  RETRYABLE_CODES,
  retryDelay,
};

/** Protocol version this module speaks. */
export const PROTOCOL_VERSION = 1;

/**
 * @typedef {"pending"|"streaming"|"done"|"error"} StreamState
 * @typedef {{id: string, type: "function", function: {name: string, arguments: string}}} ToolCall
 *   a call an answer made (the `done` frame's `tool_calls`; `arguments` is a JSON string)
 * @typedef {{index: number, id?: string, type?: "function",
 *   function: {name?: string, arguments: string}}} ToolCallDelta
 *   one entry of a `token` frame's `tool_calls` (OpenAI's `delta.tool_calls`): a call's first
 *   entry has its `id`, `type` and `name`; each entry an `arguments` fragment
 * @typedef {{seq: number, index: number, id: string, name: string, first: boolean,
 *   argumentsDelta: string, arguments: string}} ToolCallEvent
 *   the `tool-call` event of one delta: the call's `id` and `name`, whether this is its
 *   `first` entry, the fragment and its `arguments` so far
 * @typedef {{role: "system"|"user", content: string}
 *   | {role: "assistant", content?: string|null, tool_calls?: ToolCall[]}
 *   | {role: "tool", content: string, tool_call_id: string}} ChatMessage
 *   an assistant message that made calls carries them (`content` may then be null); a `tool`
 *   message answers one of them by its id
 * @typedef {{max_tokens?: number, temperature?: number, top_p?: number, top_k?: number,
 *   seed?: number, stop?: string|string[], ignore_eos?: boolean, min_p?: number,
 *   presence_penalty?: number, frequency_penalty?: number, repetition_penalty?: number,
 *   logit_bias?: Record<string, number>, stop_token_ids?: number[],
 *   logprobs?: number|null, response_format?: {type: "text"|"json_object"}
 *   | {type: "json_schema", json_schema: {name?: string, schema: Record<string, unknown>,
 *   strict?: boolean|null, description?: string}} | null,
 *   tools?: {type: "function", function: {name: string, description?: string,
 *   parameters?: Record<string, unknown>, strict?: boolean}}[],
 *   tool_choice?: "none"|"auto"|"required"|{type: "function", function: {name: string}},
 *   parallel_tool_calls?: boolean, n?: 1, detach_timeout?: number}} GenerateParams
 *   `detach_timeout`: seconds the stream keeps generating with no client attached (at most
 *   the hello's `max_detach_timeout`; default: its `detach_timeout`)
 * @typedef {{messages?: ChatMessage[], prompt?: string, params?: GenerateParams,
 *   model?: string, requestId?: string, traceparent?: string}} GenerateRequest
 *   `model`: one of the gateway's `GET /v1/models` (default: the gateway's default model)
 * @typedef {{streamId: string, resumeToken: string, after?: number, text?: string,
 *   toolCalls?: ToolCall[]}} ResumeRequest
 *   `text`, `toolCalls`: what is already held up to `after`
 * @typedef {{prompt_tokens: number, completion_tokens: number}} Usage
 * @typedef {{code: string, message: string, retryAfter?: number}} StreamError
 *   `retryAfter`: seconds, from the error frame's `retry_after` (rate_limited, overloaded)
 * @typedef {{resumes: number, duplicates: number, gaps: number, retries: number}} ProtocolStats
 * @typedef {"started"|"token"|"tool-call"|"resumed"|"done"|"error"|"cancel-ack"} StreamEventName
 * @typedef {"open"|"readiness"|"notice"|"error"} ClientEventName
 */

/**
 * What the I/O layer must do, in order:
 * - `send`: write `frame` (JSON) on connection `conn` (drop it if that socket is gone);
 * - `stream`: dispatch event `name` with `detail` on the stream;
 * - `client`: dispatch event `name` with `detail` on the client;
 * - `timer`: call `timer(key)` after `delay` ms (replacing a timer with the same key);
 * - `clear-timer`: forget the timer `key`;
 * - `drain`: connection `conn` drains (the gateway shuts down within `drainS` s): open the next
 *   connection now; keep this one until it closes, its streams still arrive on it.
 * @typedef {{type: "send", conn: number, frame: Record<string, unknown>}
 *   | {type: "stream", stream: ProtocolStream, name: StreamEventName,
 *      detail: Record<string, unknown>}
 *   | {type: "client", name: ClientEventName, detail: Record<string, unknown>}
 *   | {type: "timer", key: string, delay: number}
 *   | {type: "clear-timer", key: string}
 *   | {type: "drain", conn: number, drainS: number|null}} Action
 */

/**
 * Options of the state machine. Every field is optional.
 * @typedef {object} ProtocolOptions
 * @property {number} [cancelTimeout=5000] ms to wait for the server's `done` after cancel()
 *   before ending the stream locally as cancelled (0: wait for ever).
 * @property {number} [retryLimit=8] times a generate or resume refused with a retryable code
 *   (`unavailable`, `overloaded`, `rate_limited`) is sent again before the stream fails with
 *   that error (0: never).
 * @property {number} [retryMaxDelay=30000] ms: a `retry_after` longer than this is not waited
 *   out; the stream fails at once with the error (its `retryAfter` says when to try again).
 * @property {number} [backoffInitial=250] first retry delay (ms, before jitter).
 * @property {number} [backoffMax=10000] longest retry delay (ms, plus `retry_after`).
 * @property {number} [backoffFactor=2] growth factor between attempts.
 * @property {number} [backoffJitter=0.5] 0..1: each delay is drawn from [d*(1-jitter), d].
 * @property {() => number} [random] for the jitter (default `Math.random`).
 * @property {ProtocolStats} [stats] counters to update (default: a new object).
 */
