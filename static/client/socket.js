// One WebSocket of a TokenRelayClient: its ready states, closing it with no more callbacks,
// and the ping/pong heartbeat that notices when it went silent. Internal module.

export const WS_CONNECTING = 0;
export const WS_OPEN = 1;

/** Close codes after which reconnecting cannot help (policy violation). */
export const FATAL_CLOSE_CODES = new Set([1008]);

/**
 * @typedef {{setTimeout: (fn: () => void, ms: number) => unknown,
 *   clearTimeout: (id: unknown) => void}} Timers
 */

/**
 * Close `ws` with no more callbacks.
 * @param {WebSocket} ws @param {number} code @param {string} reason
 */
export function closeQuietly(ws, code, reason) {
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

/**
 * Pings every `heartbeatInterval` ms while the socket is open; when no frame at all came
 * `heartbeatTimeout` ms after a ping (alive() was not called), the socket is silent.
 */
export class Heartbeat {
  /**
   * @param {Timers} timers
   * @param {{heartbeatInterval: number, heartbeatTimeout: number}} options read at each ping
   * @param {{open: () => boolean, ping: () => void, silent: () => void}} socket whether the
   *   socket is open, send it a ping, and what to do when it went silent
   */
  constructor(timers, options, socket) {
    /** @private */ this._timers = timers;
    /** @private */ this._options = options;
    /** @private */ this._socket = socket;
    /** @type {unknown} @private */ this._pingTimer = null;
    /** @type {unknown} @private */ this._pongTimer = null;
  }

  /** (Re)start the pings: the next one in `heartbeatInterval` ms. */
  start() {
    if (this._pingTimer) this._timers.clearTimeout(this._pingTimer);
    this._pingTimer = this._timers.setTimeout(() => {
      this._pingTimer = null;
      if (!this._socket.open()) return;
      if (!this._pongTimer) {
        this._pongTimer = this._timers.setTimeout(() => {
          this._pongTimer = null;
          this._socket.silent();
        }, this._options.heartbeatTimeout);
      }
      this.start();
      this._socket.ping();
    }, this._options.heartbeatInterval);
  }

  /** A frame came: the socket is alive. */
  alive() {
    if (this._pongTimer) this._timers.clearTimeout(this._pongTimer);
    this._pongTimer = null;
  }

  /** No more pings (the socket is gone). */
  stop() {
    if (this._pingTimer) this._timers.clearTimeout(this._pingTimer);
    if (this._pongTimer) this._timers.clearTimeout(this._pongTimer);
    this._pingTimer = null;
    this._pongTimer = null;
  }
}
