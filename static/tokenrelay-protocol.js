// tokenrelay-protocol.js: the client side of tokenrelay's WebSocket protocol v1, sans I/O.
//
// A state machine: user calls (generate, resume, cancel), connection events (opened, closed),
// received frames and timer expirations go in; actions come out: frames to send on a given
// connection, events for a stream or for the client, timers to set or clear, and "this
// connection drains, open the next one". It opens no socket and sets no timer:
// tokenrelay-client.js does that around it, as gateway/ws/connection.py does around
// gateway/ws/protocol.py. What it owns is what makes streamed text exactly-once: per-stream
// seq bookkeeping (drop repeats, replay from the last seq on a gap), resume offsets, cancel,
// and which refusals are retried, when, and how often.
//
//   const p = new ClientProtocol();
//   const s = p.generate({messages: [{role: "user", content: "Hi"}]});
//   p.opened(1);                         // a socket (id 1) is open
//   p.receive(1, JSON.parse(data));      // every frame received on it
//   for (let a; (a = p.nextAction()); ) perform(a);   // send, emit, set timers...
//
// Reference: docs/client.md (the client) and docs/protocol.md (the wire protocol).

/** Protocol version this module speaks. */
export const PROTOCOL_VERSION = 1;

/**
 * Error codes after which a generate (or a resume) is sent again, with backoff, honouring the
 * frame's `retry_after`, up to `retryLimit` times.
 * @type {readonly ["unavailable", "overloaded", "rate_limited"]}
 */
export const RETRYABLE_CODES = Object.freeze(
  /** @type {["unavailable", "overloaded", "rate_limited"]} */ ([
    "unavailable",
    "overloaded",
    "rate_limited",
  ]),
);

/**
 * @typedef {"pending"|"streaming"|"done"|"error"} StreamState
 * @typedef {{role: "system"|"user"|"assistant", content: string}} ChatMessage
 * @typedef {{max_tokens?: number, temperature?: number, top_p?: number, top_k?: number,
 *   seed?: number, stop?: string|string[], ignore_eos?: boolean}} GenerateParams
 * @typedef {{messages?: ChatMessage[], prompt?: string, params?: GenerateParams,
 *   requestId?: string}} GenerateRequest
 * @typedef {{streamId: string, resumeToken: string, after?: number, text?: string}} ResumeRequest
 * @typedef {{prompt_tokens: number, completion_tokens: number}} Usage
 * @typedef {{code: string, message: string, retryAfter?: number}} StreamError
 *   `retryAfter`: seconds, from the error frame's `retry_after` (rate_limited, overloaded)
 * @typedef {{resumes: number, duplicates: number, gaps: number, retries: number}} ProtocolStats
 * @typedef {"started"|"token"|"resumed"|"done"|"error"|"cancel-ack"} StreamEventName
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

/** @type {Readonly<Required<Omit<ProtocolOptions, "random"|"stats">>>} */
export const PROTOCOL_DEFAULTS = Object.freeze({
  cancelTimeout: 5000,
  retryLimit: 8,
  retryMaxDelay: 30000,
  backoffInitial: 250,
  backoffMax: 10000,
  backoffFactor: 2,
  backoffJitter: 0.5,
});

/**
 * Delay before attempt `attempt` (0 = the first retry): exponential backoff capped at
 * `backoffMax`, minus a random share of up to `backoffJitter` of it.
 * @param {number} attempt
 * @param {{backoffInitial?: number, backoffMax?: number, backoffFactor?: number,
 *   backoffJitter?: number}} [options]
 * @param {() => number} [random]
 * @returns {number} milliseconds
 */
export function backoffDelay(attempt, options = {}, random = Math.random) {
  const o = { ...PROTOCOL_DEFAULTS, ...options };
  const base = Math.min(o.backoffMax, o.backoffInitial * o.backoffFactor ** Math.max(0, attempt));
  const jitter = Math.min(1, Math.max(0, o.backoffJitter));
  return Math.round(base * (1 - jitter * random()));
}

/**
 * Delay before retry number `attempt` (1 = the first) of a refused generate or resume: the
 * server's `retry_after` (seconds, when it sent one) plus the jittered backoff, so that
 * clients refused together do not all come back in the same millisecond.
 * @param {number} attempt
 * @param {number|null|undefined} retryAfter seconds
 * @param {{backoffInitial?: number, backoffMax?: number, backoffFactor?: number,
 *   backoffJitter?: number}} [options]
 * @param {() => number} [random]
 * @returns {number} milliseconds
 */
export function retryDelay(attempt, retryAfter, options = {}, random = Math.random) {
  const server = typeof retryAfter === "number" && retryAfter > 0 ? retryAfter * 1000 : 0;
  return Math.round(server + backoffDelay(attempt, options, random));
}

/** @param {string} prefix */
function randomId(prefix) {
  const bytes = new Uint8Array(9);
  globalThis.crypto.getRandomValues(bytes);
  let s = "";
  for (const b of bytes) s += b.toString(16).padStart(2, "0");
  return `${prefix}-${s}`;
}

/** @param {unknown} value @returns {value is string} */
function isText(value) {
  return typeof value === "string" && value.length > 0;
}

/**
 * The protocol's record of one stream. The I/O layer reads it; only {@link ClientProtocol}
 * changes it.
 */
export class ProtocolStream {
  /**
   * @param {number} id local handle (timer keys use it)
   * @param {{requestId?: string|null, frame?: Record<string, unknown>|null,
   *   streamId?: string|null, resumeToken?: string|null, lastSeq?: number,
   *   text?: string}} init
   */
  constructor(id, init) {
    /** @readonly */ this.id = id;
    /** @type {string|null} */ this.requestId = init.requestId ?? null;
    /** @type {string|null} */ this.streamId = init.streamId ?? null;
    /** @type {string|null} secret needed to resume or cancel from another socket */
    this.resumeToken = init.resumeToken ?? null;
    /** @type {number} seq of the last event delivered */ this.lastSeq = init.lastSeq ?? 0;
    /** @type {string} all text delivered so far */ this.text = init.text ?? "";
    /** @type {StreamState} */ this.state = this.streamId ? "streaming" : "pending";
    /** @type {number|null} */ this.promptTokens = null;
    /** @type {string|null} */ this.finishReason = null;
    /** @type {Usage|null} */ this.usage = null;
    /** @type {StreamError|null} */ this.error = null;
    /** @type {number} times this stream was re-attached with `resume` */ this.resumes = 0;
    /** @type {boolean} */ this.cancelRequested = false;
    /** @type {Record<string, unknown>|null} the generate frame (null for a resumed stream) */
    this.frame = init.frame ?? null;
    /** @type {boolean} whether the generate frame went out at least once */
    this.everSent = false;
    /** @type {number|null} the connection this stream is attached to (sent on) */
    this.conn = null;
    /** @type {boolean} a `resume` is out and its `resumed` has not come back */
    this.resyncing = false;
    /** @type {number} retries since the last success (started or resumed) */
    this.retries = 0;
    /** @type {boolean} waiting for its retry timer */ this.waiting = false;
    /** @type {boolean} its cancel timer is set */ this.cancelTimer = false;
  }

  /** @returns {boolean} whether the stream has ended (done or error) */
  get closed() {
    return this.state === "done" || this.state === "error";
  }
}

/**
 * The client side of protocol v1 over any number of connections, sans I/O. Connections are
 * numbers chosen by the caller. The newest one `opened` is the primary: new and re-attached
 * streams go there. A connection whose gateway announced a drain (`notice shutting_down`)
 * keeps delivering the streams attached to it until it closes, when they are resumed on the
 * primary; nothing new is sent on it.
 */
export class ClientProtocol {
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
    /** @private */ this._random = options.random ?? Math.random;
    /** @type {ProtocolStats} */
    this.stats = options.stats ?? { resumes: 0, duplicates: 0, gaps: 0, retries: 0 };
    /** @type {Record<string, unknown>|null} the last `hello` frame */ this.hello = null;
    /** Whether an engine worker is ready (`hello.worker_ready`, then a `worker_ready` notice). */
    this.workerReady = true;
    /** @private @type {Action[]} */ this._actions = [];
    /** @private @type {Map<number, {draining: boolean}>} open connections */
    this._conns = new Map();
    /** @private @type {number|null} */ this._primary = null;
    /** @private @type {Set<ProtocolStream>} */ this._streams = new Set();
    /** @private @type {Map<number, ProtocolStream>} */ this._byId = new Map();
    /** @private @type {Map<string, ProtocolStream>} */ this._byRequest = new Map();
    /** @private @type {Map<string, ProtocolStream>} */ this._byStream = new Map();
    /** @private */ this._nextId = 0;
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

  // --- user calls ------------------------------------------------------------------------

  /**
   * Start a completion: its `generate` goes out on the primary connection now, or on the next
   * one to open. With `cancelled` (an AbortSignal that had already fired) nothing is ever
   * sent: the stream ends at once as cancelled.
   * @param {GenerateRequest} request
   * @param {{cancelled?: boolean}} [how]
   * @returns {ProtocolStream}
   */
  generate(request, how = {}) {
    if (!request || (request.messages == null && request.prompt == null)) {
      throw new TypeError("tokenrelay: generate() needs messages or prompt");
    }
    const requestId = request.requestId ?? randomId("r");
    /** @type {Record<string, unknown>} */
    const frame = { type: "generate", request_id: requestId };
    if (request.messages != null) frame.messages = request.messages;
    else frame.prompt = request.prompt;
    if (request.params) frame.params = request.params;
    const s = new ProtocolStream(++this._nextId, { requestId, frame });
    this._track(s);
    if (how.cancelled) {
      s.cancelRequested = true;
      this._finish(s, "cancelled", null, { local: true });
    } else if (this._primary !== null) {
      this._attach(s, this._primary);
    }
    return s;
  }

  /**
   * Re-attach to a stream known from earlier (e.g. saved before a page reload): events with
   * seq > `after` are delivered; `text` is the text already held up to `after`. Resuming a
   * stream this machine already tracks returns that stream.
   * @param {ResumeRequest} request
   * @returns {ProtocolStream}
   */
  resume(request) {
    if (!request?.streamId || !request.resumeToken) {
      throw new TypeError("tokenrelay: resume() needs streamId and resumeToken");
    }
    const existing = this._byStream.get(request.streamId);
    if (existing) return existing;
    const s = new ProtocolStream(++this._nextId, {
      streamId: request.streamId,
      resumeToken: request.resumeToken,
      lastSeq: request.after ?? 0,
      text: request.text ?? "",
    });
    this._track(s);
    if (this._primary !== null) this._attach(s, this._primary);
    return s;
  }

  /**
   * Ask the server to stop `s`: a `cancel` goes out as soon as the stream id is known and a
   * connection is open; the server's `done` (`cancelled`) ends it, or the cancel timer does.
   * A generate that is out on no connection (never sent, or its socket died before `started`)
   * ends at once, locally.
   * @param {ProtocolStream} s
   */
  cancel(s) {
    if (s.closed) return;
    const first = !s.cancelRequested;
    s.cancelRequested = true;
    if (s.streamId) {
      const conn = this._live(s.conn) ? s.conn : this._primary;
      if (conn !== null) this._sendCancel(s, conn); // else: after the resume on reconnect
    } else if (!this._live(s.conn)) {
      this._finish(s, "cancelled", null, { local: true });
      return;
    } // else: the generate is out; the cancel follows its `started`
    if (first && this.options.cancelTimeout > 0) {
      s.cancelTimer = true;
      this._push({ type: "timer", key: `cancel:${s.id}`, delay: this.options.cancelTimeout });
    }
  }

  /**
   * The client was closed by its user: stop the cancel timers (streams stay known; they are
   * resumed, and their cancels sent again, on the next connection).
   */
  pause() {
    for (const s of this._streams) this._clearCancelTimer(s);
  }

  /**
   * End every unfinished stream with an error (the I/O layer gave up: a policy close, no
   * credentials, or no connection after its retries).
   * @param {string} code @param {string} message
   */
  fail(code, message) {
    for (const s of [...this._streams]) this._fail(s, code, message);
  }

  // --- connection events -----------------------------------------------------------------

  /**
   * Connection `conn` is open: it becomes the primary, and every stream not attached to an
   * open connection is attached to it (`resume` from its last seq, or its `generate` again).
   * @param {number} conn
   */
  opened(conn) {
    this._conns.set(conn, { draining: false });
    this._primary = conn;
    for (const s of [...this._streams]) {
      if (!this._live(s.conn)) this._attach(s, conn);
    }
  }

  /**
   * Connection `conn` is gone. Its streams are resumed on the primary if one is open, else on
   * the next connection to open.
   * @param {number} conn
   */
  closed(conn) {
    if (!this._conns.delete(conn)) return; // never opened: nothing went out on it
    if (this._primary === conn) this._primary = null;
    for (const s of [...this._streams]) {
      if (s.conn !== conn) continue;
      s.conn = null;
      s.resyncing = false;
      if (this._primary !== null) this._attach(s, this._primary);
    }
  }

  /**
   * A timer set by a `timer` action fired.
   * @param {string} key
   */
  timer(key) {
    const [kind, id] = key.split(":");
    const s = this._byId.get(Number(id));
    if (!s || s.closed) return;
    if (kind === "cancel") {
      s.cancelTimer = false;
      this._finish(s, "cancelled", s.usage, { local: true });
    } else if (kind === "retry") {
      s.waiting = false;
      if (!this._live(s.conn) && this._primary !== null) this._attach(s, this._primary);
    }
  }

  // --- frames ----------------------------------------------------------------------------

  /**
   * A frame received on connection `conn` (already parsed from JSON). Unknown types and
   * frames about unknown streams are ignored.
   * @param {number} conn
   * @param {Record<string, any>} f
   */
  receive(conn, f) {
    if (!f || typeof f !== "object") return;
    switch (f.type) {
      case "hello":
        this.hello = f;
        this._setReady(f.worker_ready !== false);
        this._push({ type: "client", name: "open", detail: { hello: f } });
        return;
      case "notice":
        this._notice(conn, f);
        return;
      case "started": {
        const s = this._byRequest.get(f.request_id);
        if (!s || s.closed || s.streamId || !isText(f.stream_id)) return;
        s.streamId = f.stream_id;
        s.resumeToken = typeof f.resume_token === "string" ? f.resume_token : null;
        s.promptTokens = typeof f.prompt_tokens === "number" ? f.prompt_tokens : null;
        s.state = "streaming";
        s.retries = 0;
        s.conn = conn;
        this._byStream.set(f.stream_id, s);
        this._emit(s, "started", {
          streamId: s.streamId,
          resumeToken: s.resumeToken,
          promptTokens: s.promptTokens,
        });
        if (s.cancelRequested) this._sendCancel(s, conn);
        return;
      }
      case "resumed": {
        const s = this._byStream.get(f.stream_id);
        if (!s || s.closed) return;
        s.resyncing = false;
        s.retries = 0;
        s.resumes += 1;
        this.stats.resumes += 1;
        if (s.state === "pending") s.state = "streaming";
        this._emit(s, "resumed", { after: f.after });
        return;
      }
      case "token": {
        const s = this._byStream.get(f.stream_id);
        if (!s || s.closed || typeof f.seq !== "number") return;
        if (f.seq <= s.lastSeq) {
          this.stats.duplicates += 1;
          return;
        }
        if (f.seq !== s.lastSeq + 1) {
          this.stats.gaps += 1;
          this._resync(s, conn);
          return;
        }
        s.lastSeq = f.seq;
        const text = typeof f.text === "string" ? f.text : "";
        s.text += text;
        this._emit(s, "token", { seq: f.seq, text, fullText: s.text });
        return;
      }
      case "done": {
        const s = this._byStream.get(f.stream_id);
        if (!s || s.closed) return;
        if (typeof f.seq === "number" && f.seq > s.lastSeq + 1) {
          this.stats.gaps += 1;
          this._resync(s, conn);
          return;
        }
        if (typeof f.seq === "number") s.lastSeq = Math.max(s.lastSeq, f.seq);
        this._finish(s, f.finish_reason ?? "stop", f.usage ?? null, { message: f.message });
        return;
      }
      case "cancelled": {
        const s = this._byStream.get(f.stream_id);
        if (s && !s.closed) {
          this._emit(s, "cancel-ack", { state: f.state, finishReason: f.finish_reason ?? null });
        }
        return;
      }
      case "error": {
        const s =
          (isText(f.stream_id) && this._byStream.get(f.stream_id)) ||
          (isText(f.request_id) && this._byRequest.get(f.request_id)) ||
          null;
        if (s && !s.closed) this._error(s, conn, f);
        else {
          this._push({
            type: "client",
            name: "error",
            detail: { code: f.code, message: f.message, frame: f },
          });
        }
        return;
      }
      default:
        return; // pong, and unknown frame types (forward compatible)
    }
  }

  // --- internals -------------------------------------------------------------------------

  /** @private @param {Action} action */
  _push(action) {
    this._actions.push(action);
  }

  /**
   * @private @param {ProtocolStream} s @param {StreamEventName} name
   * @param {Record<string, unknown>} detail
   */
  _emit(s, name, detail) {
    this._push({ type: "stream", stream: s, name, detail });
  }

  /** @private @param {number|null} conn @returns {conn is number} */
  _live(conn) {
    return conn !== null && this._conns.has(conn);
  }

  /** @private @param {ProtocolStream} s */
  _track(s) {
    this._streams.add(s);
    this._byId.set(s.id, s);
    if (s.requestId) this._byRequest.set(s.requestId, s);
    if (s.streamId) this._byStream.set(s.streamId, s);
  }

  /**
   * Send what a stream needs on connection `conn`.
   * @private @param {ProtocolStream} s @param {number} conn
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

  /** @private @param {ProtocolStream} s @param {number} conn */
  _sendCancel(s, conn) {
    this._push({
      type: "send",
      conn,
      frame: { type: "cancel", stream_id: s.streamId, resume_token: s.resumeToken },
    });
  }

  /**
   * Ask for a replay from the last seq (a gap).
   * @private @param {ProtocolStream} s @param {number} conn
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

  /** @private @param {number} conn @param {Record<string, any>} f */
  _notice(conn, f) {
    if (f.code === "worker_ready") {
      this._setReady(true);
      // generates refused while no worker was ready need not wait out their backoff
      for (const s of [...this._streams]) {
        if (s.waiting && !s.streamId) {
          s.waiting = false;
          this._push({ type: "clear-timer", key: `retry:${s.id}` });
          if (this._primary !== null) this._attach(s, this._primary);
        }
      }
    } else if (f.code === "shutting_down") {
      const info = this._conns.get(conn);
      if (info && !info.draining) {
        info.draining = true;
        if (this._primary === conn) this._primary = null;
        const drainS = typeof f.drain_s === "number" ? f.drain_s : null;
        this._push({ type: "drain", conn, drainS });
      }
    }
    this._push({
      type: "client",
      name: "notice",
      detail: { code: f.code, message: f.message ?? "", drainS: f.drain_s ?? null },
    });
  }

  /**
   * An error frame about one of our streams: retry it (a retryable code, under the limit),
   * or fail it.
   * @private @param {ProtocolStream} s @param {number} conn @param {Record<string, any>} f
   */
  _error(s, conn, f) {
    const code = typeof f.code === "string" ? f.code : "internal";
    const message = typeof f.message === "string" ? f.message : "error";
    const retryAfter =
      typeof f.retry_after === "number" && f.retry_after >= 0 ? f.retry_after : null;
    if (!(/** @type {readonly string[]} */ (RETRYABLE_CODES).includes(code))) {
      this._fail(s, code, message, retryAfter);
      return;
    }
    // "An error with a stream_id also means this socket no longer delivers that stream."
    if (s.conn === conn) s.conn = null;
    s.resyncing = false;
    if (code === "unavailable" && this.draining(conn)) {
      // refused because the gateway drains: straight to the next connection, not counted
      if (this._primary !== null) this._attach(s, this._primary);
      return;
    }
    const limit = Math.max(0, this.options.retryLimit);
    if (
      s.retries >= limit ||
      (retryAfter !== null && retryAfter * 1000 > this.options.retryMaxDelay)
    ) {
      this._fail(s, code, message, retryAfter);
      return;
    }
    s.retries += 1;
    this.stats.retries += 1;
    s.waiting = true;
    this._push({
      type: "timer",
      key: `retry:${s.id}`,
      delay: retryDelay(s.retries, retryAfter, this.options, this._random),
    });
  }

  /** @private @param {boolean} ready */
  _setReady(ready) {
    if (ready === this.workerReady) return;
    this.workerReady = ready;
    this._push({ type: "client", name: "readiness", detail: { ready } });
  }

  /** @private @param {ProtocolStream} s */
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
   * @private @param {ProtocolStream} s @param {string} finishReason
   * @param {Usage|null} usage @param {{local?: boolean, message?: string}} [extra]
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
    this._emit(s, "done", detail);
  }

  /**
   * @private @param {ProtocolStream} s @param {string} code @param {string} message
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
