// TokenRelayClient: the API of the client (tokenrelay-client.js, its public entry): connect
// and close, streams (generate, resume, and the TokenRelayStream of each), the server's hello
// and worker readiness, over the socket layer of Connection (client/connection.js); and
// performing what the sans-I/O ClientProtocol asks: frames, stream and client events,
// timers, drains. Internal module: use tokenrelay-client.js.

import { Connection } from "./connection.js";
import { event, TokenRelayStream } from "./stream.js";

/**
 * @typedef {import("../tokenrelay-protocol.js").ProtocolStream} ProtocolStream
 * @typedef {import("../tokenrelay-protocol.js").Action} Action
 * @typedef {import("../tokenrelay-client.js").ClientOptions} ClientOptions
 * @typedef {import("../tokenrelay-client.js").GenerateRequest} GenerateRequest
 * @typedef {import("../tokenrelay-client.js").ResumeRequest} ResumeRequest
 */

/**
 * A protocol v1 client. Events (CustomEvent, data in `event.detail`):
 * - `state` `{state, previous, attempt, delay}`: connection state changes
 * - `open` `{hello}`: the server said hello on a new socket
 * - `readiness` `{ready}`: an engine worker became ready (after a hello that said none was)
 * - `notice` `{code, message, drainS}`: information from the gateway (`shutting_down`...)
 * - `resumed` `{stream, after}`: a stream was re-attached
 * - `heartbeat-timeout` `{}`: the socket went silent and is being replaced
 * - `error` `{code, message, frame}`: an error frame not tied to a stream of ours
 * - `frame` `{frame}`: every frame received (for debugging tools)
 */
export class TokenRelayClient extends Connection {
  /** @param {ClientOptions} [options] */
  constructor(options = {}) {
    super(options);
    /** @type {WeakMap<ProtocolStream, TokenRelayStream>} @private */
    this._handles = new WeakMap();
    /** @type {Map<string, unknown>} @private timers the protocol asked for */
    this._protoTimers = new Map();
  }

  /** @returns {TokenRelayStream[]} the streams not yet finished */
  get streams() {
    return this._proto.streams.map((r) => this._handle(r));
  }

  /** @returns {Record<string, unknown>|null} the last `hello` frame */
  get hello() {
    return this._proto.hello;
  }

  /**
   * @returns {boolean} whether an engine worker is ready (`hello.worker_ready`, then a
   *   `worker_ready` notice); a generate sent before gets `unavailable` (and is retried)
   */
  get workerReady() {
    return this._proto.workerReady;
  }

  /** Open the connection (also done by generate()/resume()). Idempotent. */
  connect() {
    this._closedByUser = false;
    this._listen(true);
    if (this._ws || this._tokenPending) return;
    this._clearRetry();
    this._open();
  }

  /**
   * Close the connection and stop reconnecting. Unfinished streams stay known: a later
   * connect() resumes them.
   */
  close() {
    this._closedByUser = true;
    this._tokenPending = 0;
    this._listen(false);
    this._clearRetry();
    this._dropAll(1000, "client closed");
    this._proto.pause();
    this._pump();
    this._setState("closed");
  }

  /**
   * For QA: close the socket as if the network had dropped it. The client reconnects with
   * its usual backoff and resumes every unfinished stream.
   */
  dropConnection() {
    if (!this._ws && !this._draining.size) return;
    this.stats.drops += 1;
    this._dropAll(4000, "dropped by the client (QA)");
    this._scheduleReconnect();
  }

  /**
   * Start a completion. With `signal`, aborting it cancels the stream (nothing is sent if it
   * had already aborted) and makes iterating the stream throw.
   * @param {GenerateRequest} request
   * @returns {TokenRelayStream}
   */
  generate(request) {
    const signal = request?.signal ?? null;
    const record = this._proto.generate(request, { cancelled: signal?.aborted === true });
    const stream = this._adopt(record, signal);
    if (signal?.aborted) {
      stream._aborted = true;
      stream._abortReason = signal.reason;
    }
    this._pump();
    if (!record.closed) this._kick();
    return stream;
  }

  /**
   * Re-attach to a stream known from an earlier session (e.g. saved before a page reload):
   * events with seq > `after` are delivered; `text` is the text already held up to `after`.
   * @param {ResumeRequest} request
   * @returns {TokenRelayStream}
   */
  resume(request) {
    const signal = request?.signal ?? null;
    const record = this._proto.resume(request);
    const stream = this._handles.get(record) ?? this._adopt(record, signal);
    this._pump();
    if (signal?.aborted) stream._abort();
    this._kick();
    return stream;
  }

  // --- internals -------------------------------------------------------------------------

  /** @private @param {ProtocolStream} record @param {AbortSignal|null} signal */
  _adopt(record, signal) {
    const stream = new TokenRelayStream(this, record, signal);
    this._handles.set(record, stream);
    return stream;
  }

  /** @private @param {ProtocolStream} record @returns {TokenRelayStream} */
  _handle(record) {
    return this._handles.get(record) ?? this._adopt(record, null);
  }

  /** @internal @param {TokenRelayStream} stream */
  _cancel(stream) {
    this._proto.cancel(stream._record);
    this._pump();
  }

  /** @private connect if nothing is connecting or waiting to */
  _kick() {
    if (this._ws || this._retryTimer || this._tokenPending) return;
    if (this.options.autoConnect) this.connect();
  }

  /** Perform what the protocol asks, in order (re-entrant: a nested call carries on). @protected */
  _pump() {
    for (let a = this._proto.nextAction(); a; a = this._proto.nextAction()) this._apply(a);
  }

  /** @private @param {Action} a */
  _apply(a) {
    switch (a.type) {
      case "send":
        this._sendOn(a.conn, a.frame);
        return;
      case "stream": {
        const stream = this._handles.get(a.stream);
        if (!stream) return;
        stream._emit(a.name, a.detail);
        if (a.name === "resumed") {
          this.dispatchEvent(event("resumed", { stream, after: a.detail.after }));
        }
        return;
      }
      case "client":
        if (a.name === "open") this._attempt = 0; // a hello: the backoff starts over
        this.dispatchEvent(event(a.name, a.detail));
        return;
      case "timer": {
        this._clearProtoTimer(a.key);
        const handle = this._timers.setTimeout(() => {
          if (this._protoTimers.get(a.key) !== handle) return;
          this._protoTimers.delete(a.key);
          this._proto.timer(a.key);
          this._pump();
        }, a.delay);
        this._protoTimers.set(a.key, handle);
        return;
      }
      case "clear-timer":
        this._clearProtoTimer(a.key);
        return;
      case "drain":
        this._drain(a.conn, a.drainS);
        return;
      default:
        return;
    }
  }

  /** @private @param {string} key */
  _clearProtoTimer(key) {
    if (!this._protoTimers.has(key)) return;
    this._timers.clearTimeout(this._protoTimers.get(key));
    this._protoTimers.delete(key);
  }
}
