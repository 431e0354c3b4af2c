// ProtocolState: the bookkeeping under ClientProtocol (client/protocol.js), sans I/O. It holds
// the streams (by local id, request id and stream id), the connections (which one is the
// primary, which drain), the queue of actions for the I/O layer, and the transitions every
// input shares: attach a stream to a connection (resume it, or send its generate), ask for a
// replay, send a cancel, finish or fail a stream. ClientProtocol adds the inputs: user calls,
// connection events, timers and frames. Internal module: use tokenrelay-protocol.js.

/**
 * @typedef {import("../tokenrelay-protocol.js").Action} Action
 * @typedef {import("../tokenrelay-protocol.js").ProtocolOptions} ProtocolOptions
 * @typedef {import("../tokenrelay-protocol.js").ProtocolStats} ProtocolStats
 * @typedef {import("../tokenrelay-protocol.js").StreamEventName} StreamEventName
 * @typedef {import("../tokenrelay-protocol.js").StreamError} StreamError
 * @typedef {import("../tokenrelay-protocol.js").Usage} Usage
 * @typedef {import("./protocol-stream.js").ProtocolStream} ProtocolStream
 */

import { PROTOCOL_DEFAULTS } from "./retry.js";

/**
 * The state of ClientProtocol and the transitions its inputs share; see there.
 */
export class ProtocolState {
  /** @param {ProtocolOptions} [options] */
  constructor(options = {}) {
    /** @type {Required<Omit<ProtocolOptions, "random"|"stats">>} */
    this.options = { ...PROTOCOL_DEFAULTS };
    for (const key of /** @type {(keyof typeof PROTOCOL_DEFAULTS)[]} */ (
      Object.keys(PROTOCOL_DEFAULTS)
    )) {
      const value = options[key];
      if (value !== undefined) this.options[key] = value;
    }
    /** @protected */ this._random = options.random ?? Math.random;
    /** @type {ProtocolStats} */
    this.stats = options.stats ?? { resumes: 0, duplicates: 0, gaps: 0, retries: 0 };
    /** @type {Record<string, unknown>|null} the last `hello` frame */ this.hello = null;
    /** Whether an engine worker is ready (`hello.worker_ready`, then a `worker_ready` notice). */
    this.workerReady = true;
    /** @private @type {Action[]} */ this._actions = [];
    /** @protected @type {Map<number, {draining: boolean}>} open connections */
    this._conns = new Map();
    /** @protected @type {number|null} */ this._primary = null;
    /** @protected @type {Set<ProtocolStream>} */ this._streams = new Set();
    /** @protected @type {Map<number, ProtocolStream>} */ this._byId = new Map();
    /** @protected @type {Map<string, ProtocolStream>} */ this._byRequest = new Map();
    /** @protected @type {Map<string, ProtocolStream>} */ this._byStream = new Map();
    /** @protected */ this._nextId = 0;
  }

  // --- output ----------------------------------------------------------------------------

  /** @returns {Action|undefined} the next action to perform, in order (undefined: none) */
  nextAction() {
    return this._actions.shift();
  }

  /** Every pending action, in order (and none left). @returns {Action[]} */
  takeActions() {
    return this._actions.splice(0);
  }

  // --- state -----------------------------------------------------------------------------

  /** @returns {ProtocolStream[]} the streams not yet finished */
  get streams() {
    return [...this._streams];
  }

  /** @returns {number|null} the connection new frames go to (null: none is open) */
  get primary() {
    return this._primary;
  }

  /** @param {number} conn @returns {boolean} whether `conn` is open and draining */
  draining(conn) {
    return this._conns.get(conn)?.draining === true;
  }

  /** @param {string} streamId @returns {ProtocolStream|undefined} */
  stream(streamId) {
    return this._byStream.get(streamId);
  }

  // --- internals -------------------------------------------------------------------------

  /** @protected @param {Action} action */
  _push(action) {
    this._actions.push(action);
  }

  /**
   * @protected @param {ProtocolStream} s @param {StreamEventName} name
   * @param {Record<string, unknown>} detail
   */
  _emit(s, name, detail) {
    this._push({ type: "stream", stream: s, name, detail });
  }

  /** @protected @param {number|null} conn @returns {conn is number} */
  _live(conn) {
    return conn !== null && this._conns.has(conn);
  }

  /** @protected @param {ProtocolStream} s */
  _track(s) {
    this._streams.add(s);
    this._byId.set(s.id, s);
    if (s.requestId) this._byRequest.set(s.requestId, s);
    if (s.streamId) this._byStream.set(s.streamId, s);
  }

  /**
   * Send what a stream needs on connection `conn`.
   * @protected @param {ProtocolStream} s @param {number} conn
   */
  _attach(s, conn) {
    if (s.closed || s.waiting) return;
    if (s.streamId && s.resumeToken) {
      s.conn = conn;
      s.resyncing = true;
      this._push({
        type: "send",
        conn,
        frame: {
          type: "resume",
          stream_id: s.streamId,
          resume_token: s.resumeToken,
          after: s.lastSeq,
        },
      });
      if (s.cancelRequested) this._sendCancel(s, conn);
    } else if (s.frame) {
      if (s.cancelRequested) {
        // never started as far as we know, and nobody wants it any more
        this._finish(s, "cancelled", null, { local: true });
        return;
      }
      // (Re)send the generate. A copy an earlier socket may have started is abandoned; the
      // server aborts it after --detach-timeout.
      s.conn = conn;
      s.everSent = true;
      this._push({ type: "send", conn, frame: s.frame });
    }
  }

  /** @protected @param {ProtocolStream} s @param {number} conn */
  _sendCancel(s, conn) {
    this._push({
      type: "send",
      conn,
      frame: { type: "cancel", stream_id: s.streamId, resume_token: s.resumeToken },
    });
  }

  /**
   * Ask for a replay from the last seq (a gap).
   * @protected @param {ProtocolStream} s @param {number} conn
   */
  _resync(s, conn) {
    if (s.resyncing) return;
    s.resyncing = true;
    this._push({
      type: "send",
      conn: this._live(s.conn) ? s.conn : conn,
      frame: {
        type: "resume",
        stream_id: s.streamId,
        resume_token: s.resumeToken,
        after: s.lastSeq,
      },
    });
  }

  /** @protected @param {boolean} ready */
  _setReady(ready) {
    if (ready === this.workerReady) return;
    this.workerReady = ready;
    this._push({ type: "client", name: "readiness", detail: { ready } });
  }

  /** @protected @param {ProtocolStream} s */
  _clearCancelTimer(s) {
    if (!s.cancelTimer) return;
    s.cancelTimer = false;
    this._push({ type: "clear-timer", key: `cancel:${s.id}` });
  }

  /** @private @param {ProtocolStream} s */
  _forget(s) {
    this._clearCancelTimer(s);
    if (s.waiting) {
      s.waiting = false;
      this._push({ type: "clear-timer", key: `retry:${s.id}` });
    }
    this._streams.delete(s);
    this._byId.delete(s.id);
    if (s.requestId) this._byRequest.delete(s.requestId);
    if (s.streamId) this._byStream.delete(s.streamId);
  }

  /**
   * @protected @param {ProtocolStream} s @param {string} finishReason
   * @param {Usage|null} usage
   * @param {{local?: boolean, message?: string, toolCalls?: unknown}} [extra]
   */
  _finish(s, finishReason, usage, extra = {}) {
    if (s.closed) return;
    this._forget(s);
    s.state = "done";
    s.finishReason = finishReason;
    s.usage = usage;
    /** @type {Record<string, unknown>} */
    const detail = { finishReason, usage, text: s.text, seq: s.lastSeq };
    if (extra.local) detail.local = true;
    if (extra.message !== undefined) detail.message = extra.message;
    if (Array.isArray(extra.toolCalls)) detail.toolCalls = extra.toolCalls; // params.tools
    this._emit(s, "done", detail);
  }

  /**
   * @protected @param {ProtocolStream} s @param {string} code @param {string} message
   * @param {number|null} [retryAfter]
   */
  _fail(s, code, message, retryAfter = null) {
    if (s.closed) return;
    this._forget(s);
    s.state = "error";
    /** @type {StreamError} */
    const error = { code, message };
    if (retryAfter !== null) error.retryAfter = retryAfter;
    s.error = error;
    this._emit(s, "error", { ...error });
  }
}
