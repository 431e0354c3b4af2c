// tokenrelay-client.js: the browser (and Node) client for tokenrelay's WebSocket protocol v1.
//
// One TokenRelayClient keeps one WebSocket to `/v1/ws` and carries any number of streams
// over it. It reconnects on its own (exponential backoff with jitter), notices a dead socket
// with a ping/pong heartbeat, follows the browser's online/offline events, and moves to a new
// socket as soon as a draining gateway says so. What goes over the socket is decided by the
// sans-I/O state machine in tokenrelay-protocol.js (resume offsets, dedupe by seq, cancel,
// retries of refused requests); this module is the socket, timer and event layer around it,
// so the text a stream hands out never has a doubled or missing character.
// No dependencies, no build step. Reference: docs/client.md (API), docs/protocol.md (wire).
//
// This file is the public entry (`tokenrelay-client` in the npm package): the client's types
// (JSDoc, mirrored by tokenrelay-client.d.ts) and its exports. The code is in client/:
// client.js (TokenRelayClient: its API and the protocol's actions performed), connection.js
// (its sockets, reconnects, tokens and state), socket.js (heartbeat, closing a socket),
// stream.js (TokenRelayStream, TokenRelayError) and endpoint.js (URLs, wsTokenFetcher).

import { backoffDelay, PROTOCOL_VERSION, RETRYABLE_CODES } from "./tokenrelay-protocol.js";
import { TokenRelayClient } from "./client/client.js";
import { DEFAULTS } from "./client/connection.js";
import { resolveEndpoint, wsTokenFetcher } from "./client/endpoint.js";
import { TokenRelayError, TokenRelayStream } from "./client/stream.js";

export {
  backoffDelay,
  DEFAULTS,
  PROTOCOL_VERSION,
  resolveEndpoint,
  RETRYABLE_CODES,
  TokenRelayClient,
  TokenRelayError,
  TokenRelayStream,
  wsTokenFetcher,
};
export default TokenRelayClient;

/**
 * @typedef {import("./tokenrelay-protocol.js").StreamState} StreamState
 * @typedef {import("./tokenrelay-protocol.js").ChatMessage} ChatMessage
 * @typedef {import("./tokenrelay-protocol.js").ToolCall} ToolCall
 * @typedef {import("./tokenrelay-protocol.js").ToolCallDelta} ToolCallDelta
 * @typedef {import("./tokenrelay-protocol.js").ToolCallEvent} ToolCallEvent
 * @typedef {import("./tokenrelay-protocol.js").GenerateParams} GenerateParams
 * @typedef {import("./tokenrelay-protocol.js").Usage} Usage
 * @typedef {import("./tokenrelay-protocol.js").StreamError} StreamError
 * @typedef {"idle"|"connecting"|"open"|"reconnecting"|"offline"|"closed"} ConnectionState
 * @typedef {{messages?: ChatMessage[], prompt?: string, params?: GenerateParams,
 *   model?: string, requestId?: string, signal?: AbortSignal}} GenerateRequest
 *   `model`: one of the gateway's `GET /v1/models` (default: the gateway's default model)
 *   `signal`: aborting it cancels the stream (a `cancel` frame; nothing at all is sent when
 *   it had already fired) and makes its iteration throw the signal's reason (an AbortError)
 * @typedef {{streamId: string, resumeToken: string, after?: number, text?: string,
 *   toolCalls?: ToolCall[], signal?: AbortSignal}} ResumeRequest
 *   `text`, `toolCalls`: what is already held up to `after` (see `TokenRelayStream.toJSON`)
 * @typedef {{text: string, finishReason: string|null, usage: Usage|null,
 *   error: StreamError|null}} StreamResult
 * @typedef {{connects: number, reconnects: number, resumes: number, drops: number,
 *   heartbeatTimeouts: number, duplicates: number, gaps: number, retries: number}} ClientStats
 */

/**
 * Client options. Every field is optional.
 * @typedef {object} ClientOptions
 * @property {string} [endpoint] gateway URL: `https://host`, `wss://host/v1/ws`, `/`...
 *   (default: the page's own origin). `/v1/ws` is appended unless the path already ends so.
 * @property {number} [heartbeatInterval=5000] ms between client pings.
 * @property {number} [heartbeatTimeout=4000] ms without any frame after a ping before the
 *   socket is declared dead and replaced.
 * @property {number} [connectTimeout=8000] ms a socket may take to open.
 * @property {number} [backoffInitial=250] first reconnect (and retry) delay (ms, before jitter).
 * @property {number} [backoffMax=10000] longest reconnect (and retry) delay (ms).
 * @property {number} [backoffFactor=2] growth factor between attempts.
 * @property {number} [backoffJitter=0.5] 0..1: each delay is drawn from [d*(1-jitter), d].
 * @property {number} [maxRetries=Infinity] failed connection attempts in a row before giving up.
 * @property {number} [retryLimit=8] times a generate (or resume) refused with `unavailable`,
 *   `overloaded` or `rate_limited` is sent again, after `retry_after` plus the jittered
 *   backoff, before the stream fails with that error (0: fail at once).
 * @property {number} [retryMaxDelay=30000] ms: a `retry_after` longer than this fails the
 *   stream at once (its error's `retryAfter` says when to try again) instead of waiting.
 * @property {number} [cancelTimeout=5000] ms to wait for the server's `done` after cancel()
 *   before ending the stream locally as cancelled.
 * @property {boolean} [autoConnect=true] connect on the first generate()/resume().
 * @property {string|null|(() => string|null|Promise<string|null>)} [token] credentials for
 *   a gateway with API keys: a short-lived token (from `POST /v1/ws-token`) sent as
 *   `?token=`, or a function called before every (re)connect that returns one, such as
 *   {@link wsTokenFetcher}. Never pass a long-lived API key here: URLs end up in logs.
 * @property {typeof WebSocket} [WebSocket] WebSocket constructor (default: the global one).
 * @property {Pick<EventTarget, "addEventListener"|"removeEventListener">|null} [window]
 *   where `online`/`offline` events come from (default: `globalThis.window`; null: none).
 * @property {{onLine?: boolean}|null} [navigator] (default: `globalThis.navigator`).
 * @property {() => number} [random] for the jitter (default `Math.random`).
 * @property {{setTimeout: (fn: () => void, ms: number) => unknown,
 *   clearTimeout: (id: unknown) => void}} [timers] (default: the global ones).
 */
