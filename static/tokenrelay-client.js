// tokenrelay-client.js: the browser (and Node) client for tokenrelay's WebSocket protocol v1.
//
// One TokenRelayClient keeps one WebSocket to `/v1/ws` and carries any number of streams
// over it. It reconnects on its own (exponential backoff with jitter), notices a dead socket
// with a ping/pong heartbeat, follows the browser's online/offline events, and re-attaches
// every unfinished stream with a `resume` frame from the last seq it delivered, so the text a
// stream hands out never has a doubled or missing character. No dependencies, no build step.
// Reference: docs/client.md (API) and docs/protocol.md (the wire protocol).

/** Protocol version this module speaks. */
export const PROTOCOL_VERSION = 1;

/**
 * @typedef {"idle"|"connecting"|"open"|"reconnecting"|"offline"|"closed"} ConnectionState
 * @typedef {"pending"|"streaming"|"done"|"error"} StreamState
 * @typedef {{role: "system"|"user"|"assistant", content: string}} ChatMessage
 * @typedef {{max_tokens?: number, temperature?: number, top_p?: number, top_k?: number,
 *   seed?: number, stop?: string[], ignore_eos?: boolean}} GenerateParams
 * @typedef {{messages?: ChatMessage[], prompt?: string, params?: GenerateParams,
 *   requestId?: string}} GenerateRequest
 * @typedef {{streamId: string, resumeToken: string, after?: number, text?: string}} ResumeRequest
 * @typedef {{prompt_tokens: number, completion_tokens: number}} Usage
 * @typedef {{text: string, finishReason: string|null, usage: Usage|null,
 *   error: {code: string, message: string}|null}} StreamResult
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
 * @property {number} [backoffInitial=250] first reconnect delay (ms, before jitter).
 * @property {number} [backoffMax=10000] longest reconnect delay (ms).
 * @property {number} [backoffFactor=2] growth factor between attempts.
 * @property {number} [backoffJitter=0.5] 0..1: each delay is drawn from [d*(1-jitter), d].
 * @property {number} [maxRetries=Infinity] failed attempts in a row before giving up.
 * @property {number} [cancelTimeout=5000] ms to wait for the server's `done` after cancel()
 *   before ending the stream locally as cancelled.
 * @property {boolean} [autoConnect=true] connect on the first generate()/resume().
 * @property {string|null|(() => string|null|Promise<string|null>)} [token] credentials for
 *   a gateway with API keys: a short-lived token (from `POST /v1/ws-token`) sent as
 *   `?token=`, or a function called before every (re)connect that returns one, such as
 *   {@link wsTokenFetcher}. Never pass a long-lived API key here: URLs end up in logs.
 * @property {typeof WebSocket} [WebSocket] WebSocket constructor (default: the global one).
 * @property {{addEventListener: Function, removeEventListener: Function}|null} [window]
 *   where `online`/`offline` events come from (default: `globalThis.window`; null: none).
 * @property {{onLine?: boolean}|null} [navigator] (default: `globalThis.navigator`).
 * @property {() => number} [random] for the jitter (default `Math.random`).
 * @property {{setTimeout: Function, clearTimeout: Function}} [timers] (default: global ones).
 */

/** @type {Required<Pick<ClientOptions, "heartbeatInterval"|"heartbeatTimeout"|"connectTimeout"|"backoffInitial"|"backoffMax"|"backoffFactor"|"backoffJitter"|"maxRetries"|"cancelTimeout"|"autoConnect">>} */
export const DEFAULTS = Object.freeze({
  heartbeatInterval: 5000,
  heartbeatTimeout: 4000,
  connectTimeout: 8000,
  backoffInitial: 250,
  backoffMax: 10000,
  backoffFactor: 2,
  backoffJitter: 0.5,
  maxRetries: Infinity,
  cancelTimeout: 5000,
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

/** Close codes after which reconnecting cannot help (policy violation). */
const FATAL_CLOSE_CODES = new Set([1008]);

/**
 * Delay before reconnect attempt `attempt` (0 = the first retry): exponential backoff capped
 * at `backoffMax`, minus a random share of up to `backoffJitter` of it.
 * @param {number} attempt
 * @param {{backoffInitial?: number, backoffMax?: number, backoffFactor?: number,
 *   backoffJitter?: number}} [options]
 * @param {() => number} [random]
 * @returns {number} milliseconds
 */
export function backoffDelay(attempt, options = {}, random = Math.random) {
  const o = { ...DEFAULTS, ...options };
  const base = Math.min(o.backoffMax, o.backoffInitial * o.backoffFactor ** Math.max(0, attempt));
  const jitter = Math.min(1, Math.max(0, o.backoffJitter));
  return Math.round(base * (1 - jitter * random()));
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

/** @param {string} prefix */
function randomId(prefix) {
  const bytes = new Uint8Array(9);
  globalThis.crypto.getRandomValues(bytes);
  let s = "";
  for (const b of bytes) s += b.toString(16).padStart(2, "0");
  return `${prefix}-${s}`;
}

/** @param {string} type @param {unknown} [detail] */
function event(type, detail) {
  return new CustomEvent(type, { detail });
}

/**
 * One response stream. Events (CustomEvent, data in `event.detail`):
 * - `started` `{streamId, resumeToken, promptTokens}`
 * - `token` `{seq, text, fullText}`: each seq exactly once, in order
 * - `resumed` `{after}`: the stream was re-attached after a reconnect (or by resume())
 * - `done` `{finishReason, usage, text, seq}`: finish reason stop, length, cancelled, error,
 *   expired
 * - `error` `{code, message}`: the stream failed (e.g. `not_found` for an expired stream)
 */
export class TokenRelayStream extends EventTarget {
  /**
   * @param {TokenRelayClient} client
   * @param {{requestId?: string|null, frame?: object|null, streamId?: string|null,
   *   resumeToken?: string|null, lastSeq?: number, text?: string}} init
   */
  constructor(client, init) {
    super();
    /** @internal */ this._client = client;
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
    /** @type {{code: string, message: string}|null} */ this.error = null;
    /** @type {number} times this stream was re-attached with `resume` */ this.resumes = 0;
    /** @type {boolean} */ this.cancelRequested = false;
    /** @internal */ this._frame = init.frame ?? null;
    /** @internal */ this._everSent = false;
    /** @internal */ this._socketGen = -1;
    /** @internal */ this._resyncing = false;
    /** @internal */ this._retries = 0;
    /** @internal */ this._cancelTimer = null;
    /** @internal @type {(result: StreamResult) => void} */ this._resolve = () => {};
    /** @type {Promise<StreamResult>} settles when the stream ends (never rejects) */
    this.finished = new Promise((resolve) => {
      this._resolve = resolve;
    });
  }

  /** @returns {boolean} whether the stream has ended (done or error) */
  get closed() {
    return this.state === "done" || this.state === "error";
  }

  /** Ask the server to stop this stream. The `done` event follows with `cancelled`. */
  cancel() {
    this._client._cancel(this);
  }

  /** What to persist to resume this stream later with `client.resume(...)`. */
  toJSON() {
    return {
      streamId: this.streamId,
      resumeToken: this.resumeToken,
      after: this.lastSeq,
      text: this.text,
    };
  }
}

/**
 * A protocol v1 client. Events (CustomEvent, data in `event.detail`):
 * - `state` `{state, previous, attempt, delay}`: connection state changes
 * - `open` `{hello}`: the server said hello on a new socket
 * - `readiness` `{ready}`: an engine worker became ready (after a hello that said none was)
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
      setTimeout: (/** @type {Function} */ f, /** @type {number} */ ms) =>
        globalThis.setTimeout(f, ms),
      clearTimeout: (/** @type {any} */ t) => globalThis.clearTimeout(t),
    };
    /** @private */ this._random = options.random ?? Math.random;
    /** @private */ this._window =
      options.window !== undefined ? options.window : (globalThis.window ?? null);
    /** @private */ this._navigator =
      options.navigator !== undefined ? options.navigator : (globalThis.navigator ?? null);
    /** @type {ConnectionState} @private */ this._state = "idle";
    /** @type {WebSocket|null} @private */ this._ws = null;
    /** @private */ this._gen = 0;
    /** @private */ this._attempt = 0;
    /** @private */ this._everOpened = false;
    /** @private */ this._closedByUser = false;
    /** @private set by the browser's offline event, cleared by online */ this._offline = false;
    /** @private */ this._retryTimer = null;
    /** @private */ this._pingTimer = null;
    /** @private */ this._pongTimer = null;
    /** @private */ this._connectTimer = null;
    /** @private a token request in flight (its generation), else 0 */ this._tokenPending = 0;
    /** @type {Set<TokenRelayStream>} @private */ this._streams = new Set();
    /** @type {Map<string, TokenRelayStream>} @private */ this._byRequest = new Map();
    /** @type {Map<string, TokenRelayStream>} @private */ this._byStream = new Map();
    /** @type {object|null} the last `hello` frame */ this.hello = null;
    /** Whether an engine worker is ready (`hello.worker_ready`, then a `worker_ready`
     * notice); a generate sent before gets `unavailable`. */
    this.workerReady = true;
    /** Counters for dashboards and the debug panel. */
    this.stats = {
      connects: 0,
      reconnects: 0,
      resumes: 0,
      drops: 0,
      heartbeatTimeouts: 0,
      duplicates: 0,
      gaps: 0,
    };
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
    return [...this._streams];
  }

  /** Open the connection (also done by generate()/resume()). Idempotent. */
  connect() {
    this._closedByUser = false;
    this._listen(true);
    if (this._ws) return;
    this._clearRetry();
    this._open();
  }

  /**
   * Close the connection and stop reconnecting. Unfinished streams stay known: a later
   * connect() resumes them.
   */
  close() {
    this._closedByUser = true;
    this._listen(false);
    this._clearRetry();
    this._dropSocket(1000, "client closed");
    for (const s of this._streams) this._clearCancelTimer(s);
    this._setState("closed");
  }

  /**
   * For QA: close the socket as if the network had dropped it. The client reconnects with
   * its usual backoff and resumes every unfinished stream.
   */
  dropConnection() {
    if (!this._ws) return;
    this.stats.drops += 1;
    this._dropSocket(4000, "dropped by the client (QA)");
    this._scheduleReconnect();
  }

  /**
   * Start a completion.
   * @param {GenerateRequest} request
   * @returns {TokenRelayStream}
   */
  generate(request) {
    if (!request || (request.messages == null && request.prompt == null)) {
      throw new TypeError("tokenrelay: generate() needs messages or prompt");
    }
    const requestId = request.requestId ?? randomId("r");
    /** @type {Record<string, unknown>} */
    const frame = { type: "generate", request_id: requestId };
    if (request.messages != null) frame.messages = request.messages;
    else frame.prompt = request.prompt;
    if (request.params) frame.params = request.params;
    const stream = new TokenRelayStream(this, { requestId, frame });
    this._streams.add(stream);
    this._byRequest.set(requestId, stream);
    this._kick(stream);
    return stream;
  }

  /**
   * Re-attach to a stream known from an earlier session (e.g. saved before a page reload):
   * events with seq > `after` are delivered; `text` is the text already held up to `after`.
   * @param {ResumeRequest} request
   * @returns {TokenRelayStream}
   */
  resume(request) {
    if (!request?.streamId || !request.resumeToken) {
      throw new TypeError("tokenrelay: resume() needs streamId and resumeToken");
    }
    const existing = this._byStream.get(request.streamId);
    if (existing) return existing;
    const stream = new TokenRelayStream(this, {
      streamId: request.streamId,
      resumeToken: request.resumeToken,
      lastSeq: request.after ?? 0,
      text: request.text ?? "",
    });
    this._streams.add(stream);
    this._byStream.set(request.streamId, stream);
    this._kick(stream);
    return stream;
  }

  // --- internals -------------------------------------------------------------------------

  /** @private @param {TokenRelayStream} stream */
  _kick(stream) {
    if (this._ws && this._ws.readyState === WS_OPEN) this._attach(stream);
    else if (!this._ws && !this._retryTimer && this.options.autoConnect) this.connect();
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
    const gen = ++this._gen;
    let ws;
    try {
      ws = new this._WebSocket(token ? withToken(this.url, token) : this.url);
    } catch (err) {
      this._scheduleReconnect();
      return;
    }
    this._ws = ws;
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
      for (const s of [...this._streams]) {
        if (s._socketGen !== gen) this._attach(s);
      }
    };
    ws.onmessage = (/** @type {MessageEvent} */ ev) => {
      if (this._ws !== ws) return;
      this._alive();
      let frame;
      try {
        frame = JSON.parse(typeof ev.data === "string" ? ev.data : String(ev.data));
      } catch {
        return;
      }
      if (frame && typeof frame === "object") this._handle(frame);
    };
    ws.onclose = (/** @type {CloseEvent} */ ev) => {
      if (this._ws !== ws) return;
      this._ws = null;
      this._stopTimers();
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

  /** @private @param {string} code @param {string} message */
  _fatal(code, message) {
    this._closedByUser = true;
    this._clearRetry();
    this._setState("closed", { code, message });
    for (const s of [...this._streams]) this._fail(s, code, message);
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
      if (!this._ws) this._open();
    }
  }

  /** @private */
  _handleOffline() {
    this._offline = true;
    if (this._closedByUser) return;
    this._dropSocket(4002, "browser went offline");
    this._clearRetry();
    this._scheduleReconnect(); // a slow retry (backoffMax) in case `online` never fires
  }

  /**
   * Forget the current socket (closing it) without scheduling anything.
   * @private @param {number} code @param {string} reason
   */
  _dropSocket(code, reason) {
    const ws = this._ws;
    this._ws = null;
    this._stopTimers();
    if (!ws) return;
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
    for (const name of ["_pingTimer", "_pongTimer", "_connectTimer"]) {
      // @ts-ignore dynamic private field
      if (this[name]) this._timers.clearTimeout(this[name]);
      // @ts-ignore
      this[name] = null;
    }
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
      this._send({ type: "ping" });
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

  /** @private @param {object} frame @returns {boolean} */
  _send(frame) {
    const ws = this._ws;
    if (!ws || ws.readyState !== WS_OPEN) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  /** Send what a stream needs on the current socket. @private @param {TokenRelayStream} s */
  _attach(s) {
    if (s.closed) return;
    s._socketGen = this._gen;
    if (s.streamId && s.resumeToken) {
      s._resyncing = true;
      this._send({
        type: "resume",
        stream_id: s.streamId,
        resume_token: s.resumeToken,
        after: s.lastSeq,
      });
      if (s.cancelRequested) this._sendCancel(s);
    } else if (s._frame) {
      if (s.cancelRequested && !s._everSent) {
        this._finish(s, "cancelled", null, { local: true });
        return;
      }
      // Never started as far as we know: (re)send the generate. A copy the old socket may
      // have started is abandoned and aborted by the server after --detach-timeout.
      s._everSent = true;
      this._send(s._frame);
    }
  }

  /** @private @param {TokenRelayStream} s */
  _sendCancel(s) {
    this._send({ type: "cancel", stream_id: s.streamId, resume_token: s.resumeToken });
  }

  /** @internal @param {TokenRelayStream} s */
  _cancel(s) {
    if (s.closed) return;
    const first = !s.cancelRequested;
    s.cancelRequested = true;
    if (s.streamId) {
      this._sendCancel(s); // when offline it goes out after the resume on reconnect
    } else if (!s._everSent) {
      this._finish(s, "cancelled", null, { local: true });
      return;
    } // else: sent when `started` arrives
    if (first && this.options.cancelTimeout > 0) {
      s._cancelTimer = this._timers.setTimeout(() => {
        s._cancelTimer = null;
        if (!s.closed) this._finish(s, "cancelled", s.usage, { local: true });
      }, this.options.cancelTimeout);
    }
  }

  /** @private @param {TokenRelayStream} s */
  _clearCancelTimer(s) {
    if (s._cancelTimer) this._timers.clearTimeout(s._cancelTimer);
    s._cancelTimer = null;
  }

  /** @private @param {TokenRelayStream} s */
  _resync(s) {
    if (s._resyncing) return;
    s._resyncing = true;
    this._send({
      type: "resume",
      stream_id: s.streamId,
      resume_token: s.resumeToken,
      after: s.lastSeq,
    });
  }

  /** @private @param {TokenRelayStream} s */
  _retryResume(s) {
    s._retries = (s._retries ?? 0) + 1;
    if (s._retries > 8) {
      this._fail(s, "unavailable", "the stream store stayed unreachable");
      return;
    }
    this._timers.setTimeout(() => {
      if (s.closed) return;
      s._resyncing = false;
      this._resync(s);
    }, backoffDelay(s._retries, this.options, this._random));
  }

  /** @private @param {boolean} ready */
  _setReady(ready) {
    if (ready === this.workerReady) return;
    this.workerReady = ready;
    this.dispatchEvent(event("readiness", { ready }));
  }

  /** @private @param {any} f */
  _handle(f) {
    this.dispatchEvent(event("frame", { frame: f }));
    switch (f.type) {
      case "hello":
        this.hello = f;
        this._attempt = 0;
        this._setReady(f.worker_ready !== false);
        this.dispatchEvent(event("open", { hello: f }));
        return;
      case "pong":
        return;
      case "notice":
        if (f.code === "worker_ready") this._setReady(true);
        // e.g. {"code":"shutting_down","drain_s":30}: the gateway is draining; the socket
        // closes with 1001 later and the client resumes its streams elsewhere on its own
        this.dispatchEvent(
          event("notice", { code: f.code, message: f.message ?? "", drainS: f.drain_s ?? null }),
        );
        return;
      case "started": {
        const s = this._byRequest.get(f.request_id);
        if (!s || s.closed || s.streamId) return;
        s.streamId = f.stream_id;
        s.resumeToken = f.resume_token;
        s.promptTokens = f.prompt_tokens ?? null;
        s.state = "streaming";
        this._byStream.set(s.streamId, s);
        s.dispatchEvent(
          event("started", {
            streamId: s.streamId,
            resumeToken: s.resumeToken,
            promptTokens: s.promptTokens,
          }),
        );
        if (s.cancelRequested) this._sendCancel(s);
        return;
      }
      case "resumed": {
        const s = this._byStream.get(f.stream_id);
        if (!s || s.closed) return;
        s._resyncing = false;
        s._retries = 0;
        s.resumes += 1;
        this.stats.resumes += 1;
        if (s.state === "pending") s.state = "streaming";
        s.dispatchEvent(event("resumed", { after: f.after }));
        this.dispatchEvent(event("resumed", { stream: s, after: f.after }));
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
          this._resync(s);
          return;
        }
        s.lastSeq = f.seq;
        const text = typeof f.text === "string" ? f.text : "";
        s.text += text;
        s.dispatchEvent(event("token", { seq: f.seq, text, fullText: s.text }));
        return;
      }
      case "done": {
        const s = this._byStream.get(f.stream_id);
        if (!s || s.closed) return;
        if (typeof f.seq === "number" && f.seq > s.lastSeq + 1) {
          this.stats.gaps += 1;
          this._resync(s);
          return;
        }
        if (typeof f.seq === "number") s.lastSeq = Math.max(s.lastSeq, f.seq);
        this._finish(s, f.finish_reason ?? "stop", f.usage ?? null, {
          message: f.message,
        });
        return;
      }
      case "cancelled": {
        const s = this._byStream.get(f.stream_id);
        if (s) s.dispatchEvent(event("cancel-ack", { state: f.state, finishReason: f.finish_reason }));
        return;
      }
      case "error": {
        const s =
          (f.stream_id && this._byStream.get(f.stream_id)) ||
          (f.request_id && this._byRequest.get(f.request_id)) ||
          null;
        if (s && !s.closed && f.code === "unavailable" && s.streamId) {
          this._retryResume(s); // the gateway lost its store for a moment: try again
        } else if (s && !s.closed) this._fail(s, f.code ?? "internal", f.message ?? "error");
        else {
          this.dispatchEvent(
            event("error", { code: f.code, message: f.message, frame: f }),
          );
        }
        return;
      }
      default:
        return; // unknown frame types are ignored (forward compatible)
    }
  }

  /** @private @param {TokenRelayStream} s */
  _forget(s) {
    this._clearCancelTimer(s);
    this._streams.delete(s);
    if (s.requestId) this._byRequest.delete(s.requestId);
    if (s.streamId) this._byStream.delete(s.streamId);
  }

  /**
   * @private @param {TokenRelayStream} s @param {string} finishReason
   * @param {Usage|null} usage @param {{local?: boolean, message?: string}} [extra]
   */
  _finish(s, finishReason, usage, extra = {}) {
    if (s.closed) return;
    this._forget(s);
    s.state = "done";
    s.finishReason = finishReason;
    s.usage = usage;
    s.dispatchEvent(
      event("done", { finishReason, usage, text: s.text, seq: s.lastSeq, ...extra }),
    );
    s._resolve({ text: s.text, finishReason, usage, error: null });
  }

  /** @private @param {TokenRelayStream} s @param {string} code @param {string} message */
  _fail(s, code, message) {
    if (s.closed) return;
    this._forget(s);
    s.state = "error";
    s.error = { code, message };
    s.dispatchEvent(event("error", { code, message }));
    s._resolve({ text: s.text, finishReason: null, usage: null, error: s.error });
  }
}

export default TokenRelayClient;
