// Connection: the socket layer under TokenRelayClient (client/client.js). One primary
// WebSocket to `/v1/ws` (and the sockets of a draining gateway until they close), opened with
// a fresh token when `token` is a function, kept alive by the heartbeat (client/socket.js),
// reopened with exponential backoff and jitter, following the browser's online/offline
// events; it tells the sans-I/O ClientProtocol what the sockets do (opened, a frame, closed)
// and keeps the connection state and its counters. Internal module: use tokenrelay-client.js.

import { backoffDelay, ClientProtocol, PROTOCOL_DEFAULTS } from "../tokenrelay-protocol.js";
import { resolveEndpoint, withToken } from "./endpoint.js";
import { FATAL_CLOSE_CODES, Heartbeat, WS_OPEN, closeQuietly } from "./socket.js";
import { event } from "./stream.js";

/**
 * @typedef {import("../tokenrelay-client.js").ClientOptions} ClientOptions
 * @typedef {import("../tokenrelay-client.js").ClientStats} ClientStats
 * @typedef {import("../tokenrelay-client.js").ConnectionState} ConnectionState
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

/** The sockets of a TokenRelayClient: the client is this class plus its API (client/client.js). */
export class Connection extends EventTarget {
  /** @param {ClientOptions} [options] */
  constructor(options = {}) {
    super();
    const o = { ...DEFAULTS, ...options };
    /** @readonly */ this.options = o;
    /** @readonly */ this.url = resolveEndpoint(options.endpoint);
    /** @private */ this._WebSocket = options.WebSocket ?? globalThis.WebSocket;
    /** @protected */ this._timers = options.timers ?? {
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
    /** @type {WebSocket|null} @protected the socket new frames go to (connecting or open) */
    this._ws = null;
    /** @private the connection id of `_ws` (0: none) */ this._wsConn = 0;
    /** @type {Map<number, {ws: WebSocket, timer: unknown}>} @protected draining sockets */
    this._draining = new Map();
    /** @private */ this._gen = 0;
    /** @protected */ this._attempt = 0;
    /** @private */ this._everOpened = false;
    /** @protected */ this._closedByUser = false;
    /** @private set by the browser's offline event, cleared by online */ this._offline = false;
    /** @type {unknown} @protected */ this._retryTimer = null;
    /** @type {unknown} @private */ this._connectTimer = null;
    /** @protected a token request in flight (its generation), else 0 */ this._tokenPending = 0;
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
    /** @protected the sans-I/O protocol state machine */
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
    /** @private */ this._onOnline = () => this._handleOnline();
    /** @private */ this._onOffline = () => this._handleOffline();
    /** @private */ this._listening = false;
    /** @private pings the primary socket while it is open */
    this._heartbeat = new Heartbeat(this._timers, o, {
      open: () => !!this._ws && this._ws.readyState === WS_OPEN,
      ping: () => this._sendOn(this._wsConn, { type: "ping" }),
      silent: () => this._heartbeatTimeout(),
    });
  }

  /** @returns {ConnectionState} */
  get state() {
    return this._state;
  }

  // --- internals -------------------------------------------------------------------------

  /** Perform what the protocol asks (TokenRelayClient does: client/client.js). @protected */
  _pump() {}

  /** @protected @param {number} conn @param {Record<string, unknown>} frame @returns {boolean} */
  _sendOn(conn, frame) {
    const ws = conn === this._wsConn ? this._ws : (this._draining.get(conn)?.ws ?? null);
    if (!ws || ws.readyState !== WS_OPEN) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  /** @protected @param {boolean} on */
  _listen(on) {
    const w = this._window;
    if (!w || typeof w.addEventListener !== "function" || on === this._listening) return;
    this._listening = on;
    const method = on ? "addEventListener" : "removeEventListener";
    w[method]("online", this._onOnline);
    w[method]("offline", this._onOffline);
  }

  /** @protected @param {ConnectionState} state @param {object} [extra] */
  _setState(state, extra = {}) {
    const previous = this._state;
    if (previous === state && !Object.keys(extra).length) return;
    this._state = state;
    this.dispatchEvent(event("state", { state, previous, attempt: this._attempt, ...extra }));
  }

  /** @protected */
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
      this._heartbeat.start();
      this._proto.opened(conn);
      this._pump();
    };
    ws.onmessage = (/** @type {MessageEvent} */ ev) => {
      const primary = this._ws === ws;
      if (!primary && this._draining.get(conn)?.ws !== ws) return;
      if (primary) this._heartbeat.alive();
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
   * @protected @param {number} conn @param {number|null} drainS
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
      closeQuietly(ws, 4004, "drain time over");
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

  /** @protected */
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

  /** @protected */
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
   * @protected @param {number} code @param {string} reason
   */
  _dropAll(code, reason) {
    this._dropSocket(code, reason); // first, so that nothing moves over to it
    for (const [conn, { ws, timer }] of [...this._draining]) {
      this._timers.clearTimeout(timer);
      this._draining.delete(conn);
      closeQuietly(ws, code, reason);
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
    closeQuietly(ws, code, reason);
    this._proto.closed(conn);
    this._pump();
  }

  /** @private */
  _stopTimers() {
    this._heartbeat.stop();
    if (this._connectTimer) this._timers.clearTimeout(this._connectTimer);
    this._connectTimer = null;
  }

  /** @private */
  _heartbeatTimeout() {
    if (!this._ws) return;
    this.stats.heartbeatTimeouts += 1;
    this.dispatchEvent(event("heartbeat-timeout", {}));
    this._dropSocket(4003, "heartbeat timeout");
    this._scheduleReconnect();
  }
}
