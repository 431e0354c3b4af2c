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

import {
  backoffDelay,
  ClientProtocol,
  PROTOCOL_DEFAULTS,
  PROTOCOL_VERSION,
  RETRYABLE_CODES,
} from "./tokenrelay-protocol.js";

export { backoffDelay, PROTOCOL_VERSION, RETRYABLE_CODES };

/**
 * @typedef {import("./tokenrelay-protocol.js").ProtocolStream} ProtocolStream
 * @typedef {import("./tokenrelay-protocol.js").Action} Action
 * @typedef {import("./tokenrelay-protocol.js").StreamState} StreamState
 * @typedef {import("./tokenrelay-protocol.js").ChatMessage} ChatMessage
 * @typedef {import("./tokenrelay-protocol.js").GenerateParams} GenerateParams
 * @typedef {import("./tokenrelay-protocol.js").Usage} Usage
 * @typedef {import("./tokenrelay-protocol.js").StreamError} StreamError
 * @typedef {"idle"|"connecting"|"open"|"reconnecting"|"offline"|"closed"} ConnectionState
 * @typedef {{messages?: ChatMessage[], prompt?: string, params?: GenerateParams,
 *   requestId?: string, signal?: AbortSignal}} GenerateRequest
 *   `signal`: aborting it cancels the stream (a `cancel` frame; nothing at all is sent when
 *   it had already fired) and makes its iteration throw the signal's reason (an AbortError)
 * @typedef {{streamId: string, resumeToken: string, after?: number, text?: string,
 *   signal?: AbortSignal}} ResumeRequest
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

/** @type {Readonly<Required<Pick<ClientOptions, "heartbeatInterval"|"heartbeatTimeout"|"connectTimeout"|"backoffInitial"|"backoffMax"|"backoffFactor"|"backoffJitter"|"maxRetries"|"retryLimit"|"retryMaxDelay"|"cancelTimeout"|"autoConnect">>>} */
export const DEFAULTS = Object.freeze({
  heartbeatInterval: 5000,
  heartbeatTimeout: 4000,
  connectTimeout: 8000,
  backoffInitial: PROTOCOL_DEFAULTS.backoffInitial,
  backoffMax: PROTOCOL_DEFAULTS.backoffMax,
  backoffFactor: PROTOCOL_DEFAULTS.backoffFactor,
  backoffJitter: PROTOCOL_DEFAULTS.backoffJitter,
  maxRetries: Infinity,
  retryLimit: PROTOCOL_DEFAULTS.retryLimit,
  retryMaxDelay: PROTOCOL_DEFAULTS.retryMaxDelay,
  cancelTimeout: PROTOCOL_DEFAULTS.cancelTimeout,
  autoConnect: true,
});

const WS_OPEN = 1;
const WS_CONNECTING = 0;
/**
 * `url` with `?token=` set.
 * @param {string} url @param {string} token
 */
function withToken(url, token) {
  const u = new URL(url);
  u.searchParams.set("token", token);
  return u.toString();
}

/**
 * A `token` option for {@link TokenRelayClient}: trades an API key for a short-lived
 * WebSocket token with `POST /v1/ws-token` before every connect. Resolves to null when the
 * gateway has no keys configured; rejects with an error whose `code` is "unauthorized" when
 * the key is missing or wrong (the client then stops reconnecting).
 * @param {string|null|(() => string|null|Promise<string|null>)} apiKey the key, or a function
 *   returning it (e.g. read from sessionStorage)
 * @param {{endpoint?: string, fetch?: typeof fetch}} [options]
 * @returns {() => Promise<string|null>}
 */
export function wsTokenFetcher(apiKey, options = {}) {
  const url = new URL(resolveEndpoint(options.endpoint));
  url.protocol = url.protocol === "wss:" ? "https:" : "http:";
  url.pathname = url.pathname.replace(/\/v1\/ws\/?$/, "/v1/ws-token");
  url.search = "";
  return async () => {
    const doFetch = options.fetch ?? globalThis.fetch;
    const key = typeof apiKey === "function" ? await apiKey() : apiKey;
    /** @type {Record<string, string>} */
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const resp = await doFetch(url.toString(), { method: "POST", headers });
    if (!resp.ok) {
      const err = new Error(`POST /v1/ws-token: HTTP ${resp.status}`);
      /** @type {any} */ (err).code = resp.status === 401 ? "unauthorized" : "unavailable";
      throw err;
    }
    const body = await resp.json();
    return body.token ?? null;
  };
}

/**
 * The WebSocket URL for an endpoint: http(s) becomes ws(s), relative URLs resolve against
 * `base` (default: the page's location), and `/v1/ws` is appended unless already there.
 * @param {string|undefined|null} endpoint
 * @param {string} [base]
 * @returns {string}
 */
export function resolveEndpoint(endpoint, base) {
  const origin = base ?? globalThis.location?.href;
  const url = origin ? new URL(endpoint || "/", origin) : new URL(String(endpoint));
  if (url.protocol === "http:") url.protocol = "ws:";
  else if (url.protocol === "https:") url.protocol = "wss:";
  if (url.protocol !== "ws:" && url.protocol !== "wss:") {
    throw new TypeError(`tokenrelay: endpoint must be http(s) or ws(s), got ${url.protocol}`);
  }
  if (!/\/v1\/ws\/?$/.test(url.pathname)) {
    url.pathname = `${url.pathname.replace(/\/+$/, "")}/v1/ws`;
  }
  url.hash = "";
  return url.toString();
}

/** Close codes after which reconnecting cannot help (policy violation). */
const FATAL_CLOSE_CODES = new Set([1008]);

/** @param {string} type @param {unknown} [detail] */
function event(type, detail) {
  return new CustomEvent(type, { detail });
}

/** @param {unknown} reason @returns {unknown} what an aborted operation rejects with */
function abortError(reason) {
  if (reason !== undefined) return reason;
  if (typeof DOMException === "function") {
    return new DOMException("This operation was aborted", "AbortError");
  }
  const err = new Error("This operation was aborted");
  err.name = "AbortError";
  return err;
}

/**
 * What iterating a stream throws when it ends with an error: `code` is the protocol's error
 * code (`not_found`, `unavailable`, `unauthorized`...), `retryAfter` the seconds the server
 * asked to wait (rate_limited, overloaded), or null.
 */
export class TokenRelayError extends Error {
  /**
   * @param {StreamError} error
   * @param {{streamId?: string|null, requestId?: string|null}} [where]
   */
  constructor(error, where = {}) {
    super(error.message);
    this.name = "TokenRelayError";
    /** @type {string} */ this.code = error.code;
    /** @type {number|null} */ this.retryAfter = error.retryAfter ?? null;
    /** @type {string|null} */ this.streamId = where.streamId ?? null;
    /** @type {string|null} */ this.requestId = where.requestId ?? null;
  }
}

/**
 * One response stream. Events (CustomEvent, data in `event.detail`):
 * - `started` `{streamId, resumeToken, promptTokens}`
 * - `token` `{seq, text, fullText}`: each seq exactly once, in order
 * - `resumed` `{after}`: the stream was re-attached after a reconnect (or by resume())
 * - `done` `{finishReason, usage, text, seq}`: finish reason stop, length, cancelled, error,
 *   expired
 * - `error` `{code, message, retryAfter?}`: the stream failed (e.g. `not_found` for an
 *   expired stream)
 * - `cancel-ack` `{state, finishReason}`: the server's answer to cancel()
 *
 * Also an async iterable of the text of its tokens: `for await (const text of stream)` yields
 * every chunk from the first (whenever the loop starts), ends after `done`, throws a
 * {@link TokenRelayError} after `error` and the signal's reason (an AbortError) once the
 * `signal` given to generate() aborts. Leaving the loop early (`break`) cancels the stream.
 * @implements {AsyncIterable<string>}
 */
export class TokenRelayStream extends EventTarget {
  /**
   * @param {TokenRelayClient} client
   * @param {ProtocolStream} record the protocol's state of this stream
   * @param {AbortSignal|null} [signal]
   */
  constructor(client, record, signal = null) {
    super();
    /** @internal */ this._client = client;
    /** @internal */ this._record = record;
    /** @internal @type {number[]} where each chunk ends in `text`, for the iterators */
    this._ends = record.text ? [record.text.length] : [];
    /** @internal @type {Set<() => boolean>} iterators waiting for something to happen */
    this._waiters = new Set();
    /** @internal */ this._aborted = false;
    /** @internal @type {unknown} */ this._abortReason = undefined;
    /** @internal @type {AbortSignal|null} */ this._signal = signal;
    /** @internal @type {(() => void)|null} */ this._onAbort = null;
    /** @internal @type {(result: StreamResult) => void} */ this._resolve = () => {};
    /** @type {Promise<StreamResult>} settles when the stream ends (never rejects) */
    this.finished = new Promise((resolve) => {
      this._resolve = resolve;
    });
    if (signal && !signal.aborted && !record.closed) {
      this._onAbort = () => this._abort();
      signal.addEventListener("abort", this._onAbort, { once: true });
    }
  }

  /** @returns {string|null} */
  get requestId() {
    return this._record.requestId;
  }

  /** @returns {string|null} */
  get streamId() {
    return this._record.streamId;
  }

  /** @returns {string|null} the secret needed to resume or cancel from another socket */
  get resumeToken() {
    return this._record.resumeToken;
  }

  /** @returns {number} seq of the last event delivered */
  get lastSeq() {
    return this._record.lastSeq;
  }

  /** @returns {string} all text delivered so far */
  get text() {
    return this._record.text;
  }

  /** @returns {StreamState} */
  get state() {
    return this._record.state;
  }

  /** @returns {number|null} */
  get promptTokens() {
    return this._record.promptTokens;
  }

  /** @returns {string|null} */
  get finishReason() {
    return this._record.finishReason;
  }

  /** @returns {Usage|null} */
  get usage() {
    return this._record.usage;
  }

  /** @returns {StreamError|null} */
  get error() {
    return this._record.error;
  }

  /** @returns {number} times this stream was re-attached with `resume` */
  get resumes() {
    return this._record.resumes;
  }

  /** @returns {boolean} whether cancel() was called (or the signal aborted) */
  get cancelRequested() {
    return this._record.cancelRequested;
  }

  /** @returns {boolean} whether the stream has ended (done or error) */
  get closed() {
    return this._record.closed;
  }

  /** Ask the server to stop this stream. The `done` event follows with `cancelled`. */
  cancel() {
    this._client._cancel(this);
  }

  /**
   * What to persist to resume this stream later with `client.resume(...)`.
   * @returns {{streamId: string|null, resumeToken: string|null, after: number, text: string}}
   */
  toJSON() {
    return {
      streamId: this.streamId,
      resumeToken: this.resumeToken,
      after: this.lastSeq,
      text: this.text,
    };
  }

  /** @returns {AsyncIterableIterator<string>} the text of each token, in order */
  [Symbol.asyncIterator]() {
    let index = 0;
    let offset = 0;
    let over = false;
    /** @type {IteratorResult<string>} */
    const end = { done: true, value: undefined };
    /** @type {AsyncIterableIterator<string>} */
    const iterator = {
      next: () =>
        new Promise((resolve, reject) => {
          const step = () => {
            const r = this._record;
            if (over) resolve(end);
            else if (this._aborted) {
              over = true;
              reject(abortError(this._abortReason));
            } else if (index < this._ends.length) {
              const stop = this._ends[index++];
              const value = r.text.slice(offset, stop);
              offset = stop;
              resolve({ done: false, value });
            } else if (r.state === "error" && r.error) {
              over = true;
              reject(new TokenRelayError(r.error, r));
            } else if (r.closed) {
              over = true;
              resolve(end);
            } else return false;
            return true;
          };
          if (!step()) this._waiters.add(step);
        }),
      return: () => {
        over = true;
        if (!this.closed) this.cancel();
        this._wake();
        return Promise.resolve(end);
      },
      [Symbol.asyncIterator]() {
        return iterator;
      },
    };
    return iterator;
  }

  /** @internal @param {string} name @param {Record<string, any>} detail */
  _emit(name, detail) {
    if (name === "token") this._ends.push(detail.fullText.length);
    this.dispatchEvent(event(name, detail));
    if (name === "done" || name === "error") {
      this._release();
      const r = this._record;
      this._resolve({
        text: r.text,
        finishReason: r.finishReason,
        usage: r.usage,
        error: r.error,
      });
    }
    this._wake();
  }

  /** @internal the signal fired: iterators throw, the stream is cancelled */
  _abort() {
    if (this._aborted || this.closed) return;
    this._aborted = true;
    this._abortReason = this._signal?.reason;
    this._release();
    this._wake();
    this.cancel();
  }

  /** @internal stop listening to the signal */
  _release() {
    if (this._signal && this._onAbort) {
      this._signal.removeEventListener("abort", this._onAbort);
    }
    this._onAbort = null;
  }

  /** @internal let waiting iterators look again */
  _wake() {
    for (const step of [...this._waiters]) {
      if (step()) this._waiters.delete(step);
    }
  }
}

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
export class TokenRelayClient extends EventTarget {
  /** @param {ClientOptions} [options] */
  constructor(options = {}) {
    super();
    const o = { ...DEFAULTS, ...options };
    /** @readonly */ this.options = o;
    /** @readonly */ this.url = resolveEndpoint(options.endpoint);
    /** @private */ this._WebSocket = options.WebSocket ?? globalThis.WebSocket;
    /** @private */ this._timers = options.timers ?? {
      setTimeout: (/** @type {() => void} */ f, /** @type {number} */ ms) =>
        /** @type {unknown} */ (globalThis.setTimeout(f, ms)),
      clearTimeout: (/** @type {any} */ t) => globalThis.clearTimeout(t),
    };
    /** @private */ this._random = options.random ?? Math.random;
    /** @private */ this._window =
      options.window !== undefined ? options.window : (globalThis.window ?? null);
    /** @private */ this._navigator =
      options.navigator !== undefined ? options.navigator : (globalThis.navigator ?? null);
    /** @type {ConnectionState} @private */ this._state = "idle";
    /** @type {WebSocket|null} @private the socket new frames go to (connecting or open) */
    this._ws = null;
    /** @private the connection id of `_ws` (0: none) */ this._wsConn = 0;
    /** @type {Map<number, {ws: WebSocket, timer: unknown}>} @private draining sockets */
    this._draining = new Map();
    /** @private */ this._gen = 0;
    /** @private */ this._attempt = 0;
    /** @private */ this._everOpened = false;
    /** @private */ this._closedByUser = false;
    /** @private set by the browser's offline event, cleared by online */ this._offline = false;
    /** @type {unknown} @private */ this._retryTimer = null;
    /** @type {unknown} @private */ this._pingTimer = null;
    /** @type {unknown} @private */ this._pongTimer = null;
    /** @type {unknown} @private */ this._connectTimer = null;
    /** @private a token request in flight (its generation), else 0 */ this._tokenPending = 0;
    /** Counters for dashboards and the debug panel. @type {ClientStats} */
    this.stats = {
      connects: 0,
      reconnects: 0,
      resumes: 0,
      drops: 0,
      heartbeatTimeouts: 0,
      duplicates: 0,
      gaps: 0,
      retries: 0,
    };
    /** @private the sans-I/O protocol state machine */
    this._proto = new ClientProtocol({
      cancelTimeout: o.cancelTimeout,
      retryLimit: o.retryLimit,
      retryMaxDelay: o.retryMaxDelay,
      backoffInitial: o.backoffInitial,
      backoffMax: o.backoffMax,
      backoffFactor: o.backoffFactor,
      backoffJitter: o.backoffJitter,
      random: this._random,
      stats: this.stats,
    });
    /** @type {WeakMap<ProtocolStream, TokenRelayStream>} @private */
    this._handles = new WeakMap();
    /** @type {Map<string, unknown>} @private timers the protocol asked for */
    this._protoTimers = new Map();
    /** @private */ this._onOnline = () => this._handleOnline();
    /** @private */ this._onOffline = () => this._handleOffline();
    /** @private */ this._listening = false;
  }

  /** @returns {ConnectionState} */
  get state() {
    return this._state;
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

  /** Perform what the protocol asks, in order (re-entrant: a nested call carries on). @private */
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

  /** @private @param {number} conn @param {Record<string, unknown>} frame @returns {boolean} */
  _sendOn(conn, frame) {
    const ws = conn === this._wsConn ? this._ws : (this._draining.get(conn)?.ws ?? null);
    if (!ws || ws.readyState !== WS_OPEN) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  /** @private @param {boolean} on */
  _listen(on) {
    const w = this._window;
    if (!w || typeof w.addEventListener !== "function" || on === this._listening) return;
    this._listening = on;
    const method = on ? "addEventListener" : "removeEventListener";
    w[method]("online", this._onOnline);
    w[method]("offline", this._onOffline);
  }

  /** @private @param {ConnectionState} state @param {object} [extra] */
  _setState(state, extra = {}) {
    const previous = this._state;
    if (previous === state && !Object.keys(extra).length) return;
    this._state = state;
    this.dispatchEvent(event("state", { state, previous, attempt: this._attempt, ...extra }));
  }

  /** @private */
  _open() {
    this._retryTimer = null;
    const source = this.options.token;
    if (typeof source !== "function") {
      this._openSocket(source || null);
      return;
    }
    const pending = ++this._gen;
    this._tokenPending = pending;
    if (this._state === "idle" || this._state === "closed") this._setState("connecting");
    Promise.resolve()
      .then(() => source())
      .then(
        (token) => {
          if (this._tokenPending !== pending) return;
          this._tokenPending = 0;
          if (!this._closedByUser && !this._ws) this._openSocket(token || null);
        },
        (/** @type {any} */ err) => {
          if (this._tokenPending !== pending) return;
          this._tokenPending = 0;
          if (err && err.code === "unauthorized") {
            this._fatal("unauthorized", String(err.message || err));
          } else {
            this._scheduleReconnect();
          }
        },
      );
  }

  /** @private @param {string|null} token */
  _openSocket(token) {
    const conn = ++this._gen;
    /** @type {WebSocket} */
    let ws;
    try {
      ws = new this._WebSocket(token ? withToken(this.url, token) : this.url);
    } catch (err) {
      this._scheduleReconnect();
      return;
    }
    this._ws = ws;
    this._wsConn = conn;
    if (this._state === "idle" || this._state === "closed") this._setState("connecting");
    this._connectTimer = this._timers.setTimeout(() => {
      if (this._ws === ws && ws.readyState !== WS_OPEN) {
        this._dropSocket(4001, "connect timeout");
        this._scheduleReconnect();
      }
    }, this.options.connectTimeout);
    ws.onopen = () => {
      if (this._ws !== ws) return;
      this._timers.clearTimeout(this._connectTimer);
      this._connectTimer = null;
      this.stats.connects += 1;
      if (this._everOpened) this.stats.reconnects += 1;
      this._everOpened = true;
      this._offline = false;
      this._setState("open");
      this._scheduleHeartbeat();
      this._proto.opened(conn);
      this._pump();
    };
    ws.onmessage = (/** @type {MessageEvent} */ ev) => {
      const primary = this._ws === ws;
      if (!primary && this._draining.get(conn)?.ws !== ws) return;
      if (primary) this._alive();
      let frame;
      try {
        frame = JSON.parse(typeof ev.data === "string" ? ev.data : String(ev.data));
      } catch {
        return;
      }
      if (!frame || typeof frame !== "object") return;
      this.dispatchEvent(event("frame", { frame }));
      this._proto.receive(conn, frame);
      this._pump();
    };
    ws.onclose = (/** @type {CloseEvent} */ ev) => {
      const drained = this._draining.get(conn);
      if (drained?.ws === ws) {
        // a draining gateway closed (1001): its streams resume on the new socket
        this._timers.clearTimeout(drained.timer);
        this._draining.delete(conn);
        this._proto.closed(conn);
        this._pump();
        return;
      }
      if (this._ws !== ws) return;
      this._ws = null;
      this._wsConn = 0;
      this._stopTimers();
      this._proto.closed(conn);
      this._pump();
      if (this._closedByUser) {
        this._setState("closed");
      } else if (FATAL_CLOSE_CODES.has(ev.code)) {
        this._fatal("forbidden", ev.reason || `connection refused by policy (${ev.code})`);
      } else {
        this._scheduleReconnect();
      }
    };
    ws.onerror = () => {
      /* a close event always follows */
    };
  }

  /**
   * The gateway behind connection `conn` drains (`notice shutting_down`): keep that socket
   * for the streams it carries, until it closes or the drain time is over, and open the next
   * one at once for everything new.
   * @private @param {number} conn @param {number|null} drainS
   */
  _drain(conn, drainS) {
    const ws = this._ws;
    if (!ws || conn !== this._wsConn) return;
    this._ws = null;
    this._wsConn = 0;
    this._stopTimers(); // the heartbeat belongs to the primary socket
    const grace = Math.max(0, drainS ?? 30) * 1000 + this.options.heartbeatTimeout;
    const timer = this._timers.setTimeout(() => {
      if (this._draining.get(conn)?.ws !== ws) return;
      this._draining.delete(conn);
      this._closeSocket(ws, 4004, "drain time over");
      this._proto.closed(conn);
      this._pump();
    }, grace);
    this._draining.set(conn, { ws, timer });
    if (this._closedByUser) return;
    this._clearRetry();
    this._open();
  }

  /** @private @param {string} code @param {string} message */
  _fatal(code, message) {
    this._closedByUser = true;
    this._clearRetry();
    this._dropAll(1000, message);
    this._setState("closed", { code, message });
    this._proto.fail(code, message);
    this._pump();
  }

  /** @private */
  _scheduleReconnect() {
    if (this._closedByUser || this._retryTimer) return;
    if (this._attempt >= this.options.maxRetries) {
      this._fatal("unavailable", "could not reconnect");
      return;
    }
    const offline = this._offline || this._navigator?.onLine === false;
    const delay = offline
      ? this.options.backoffMax
      : backoffDelay(this._attempt, this.options, this._random);
    this._attempt += 1;
    this._retryTimer = this._timers.setTimeout(() => this._open(), delay);
    this._setState(offline ? "offline" : "reconnecting", { delay });
  }

  /** @private */
  _clearRetry() {
    if (this._retryTimer) this._timers.clearTimeout(this._retryTimer);
    this._retryTimer = null;
  }

  /** @private */
  _handleOnline() {
    this._offline = false;
    if (this._closedByUser) return;
    if (this._state === "offline" || this._state === "reconnecting") {
      this._clearRetry();
      if (!this._ws && !this._tokenPending) this._open();
    }
  }

  /** @private */
  _handleOffline() {
    this._offline = true;
    if (this._closedByUser) return;
    this._dropAll(4002, "browser went offline");
    this._clearRetry();
    this._scheduleReconnect(); // a slow retry (backoffMax) in case `online` never fires
  }

  /**
   * Forget every socket, the draining ones too.
   * @private @param {number} code @param {string} reason
   */
  _dropAll(code, reason) {
    this._dropSocket(code, reason); // first, so that nothing moves over to it
    for (const [conn, { ws, timer }] of [...this._draining]) {
      this._timers.clearTimeout(timer);
      this._draining.delete(conn);
      this._closeSocket(ws, code, reason);
      this._proto.closed(conn);
    }
    this._pump();
  }

  /**
   * Forget the current socket (closing it) without scheduling anything.
   * @private @param {number} code @param {string} reason
   */
  _dropSocket(code, reason) {
    const ws = this._ws;
    const conn = this._wsConn;
    this._ws = null;
    this._wsConn = 0;
    this._stopTimers();
    if (!ws) return;
    this._closeSocket(ws, code, reason);
    this._proto.closed(conn);
    this._pump();
  }

  /**
   * Close `ws` with no more callbacks.
   * @private @param {WebSocket} ws @param {number} code @param {string} reason
   */
  _closeSocket(ws, code, reason) {
    ws.onmessage = null;
    ws.onerror = null;
    ws.onclose = null;
    if (ws.readyState === WS_CONNECTING) {
      // Closing a socket that is still connecting makes browsers log an error; close it
      // as soon as it opens instead.
      ws.onopen = () => ws.close(code, reason);
    } else {
      ws.onopen = null;
      try {
        ws.close(code, reason);
      } catch {
        /* already closed */
      }
    }
  }

  /** @private */
  _stopTimers() {
    if (this._pingTimer) this._timers.clearTimeout(this._pingTimer);
    if (this._pongTimer) this._timers.clearTimeout(this._pongTimer);
    if (this._connectTimer) this._timers.clearTimeout(this._connectTimer);
    this._pingTimer = null;
    this._pongTimer = null;
    this._connectTimer = null;
  }

  /** @private */
  _scheduleHeartbeat() {
    if (this._pingTimer) this._timers.clearTimeout(this._pingTimer);
    this._pingTimer = this._timers.setTimeout(() => {
      this._pingTimer = null;
      if (!this._ws || this._ws.readyState !== WS_OPEN) return;
      if (!this._pongTimer) {
        this._pongTimer = this._timers.setTimeout(
          () => this._heartbeatTimeout(),
          this.options.heartbeatTimeout,
        );
      }
      this._scheduleHeartbeat();
      this._sendOn(this._wsConn, { type: "ping" });
    }, this.options.heartbeatInterval);
  }

  /** @private any frame proves the socket alive */
  _alive() {
    if (this._pongTimer) this._timers.clearTimeout(this._pongTimer);
    this._pongTimer = null;
  }

  /** @private */
  _heartbeatTimeout() {
    this._pongTimer = null;
    if (!this._ws) return;
    this.stats.heartbeatTimeouts += 1;
    this.dispatchEvent(event("heartbeat-timeout", {}));
    this._dropSocket(4003, "heartbeat timeout");
    this._scheduleReconnect();
  }
}

export default TokenRelayClient;
