// ClientProtocol: the client side of tokenrelay's WebSocket protocol v1, sans I/O (see
// tokenrelay-protocol.js, its public entry). What goes in: user calls (generate, resume,
// cancel), connection events (opened, closed), timers that fired and received frames; what
// they do to the streams and connections kept by ProtocolState (client/protocol-state.js),
// which also queues the actions that come out. Internal module: use tokenrelay-protocol.js.

/**
 * @typedef {import("../tokenrelay-protocol.js").GenerateRequest} GenerateRequest
 * @typedef {import("../tokenrelay-protocol.js").ResumeRequest} ResumeRequest
 */

import { ProtocolState } from "./protocol-state.js";
import { ProtocolStream, toolDelta } from "./protocol-stream.js";
import { RETRYABLE_CODES, retryDelay } from "./retry.js";

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
 * The client side of protocol v1 over any number of connections, sans I/O. Connections are
 * numbers chosen by the caller. The newest one `opened` is the primary: new and re-attached
 * streams go there. A connection whose gateway announced a drain (`notice shutting_down`)
 * keeps delivering the streams attached to it until it closes, when they are resumed on the
 * primary; nothing new is sent on it.
 */
export class ClientProtocol extends ProtocolState {
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
    const n = /** @type {{n?: unknown}} */ (request.params ?? {}).n;
    if (n != null && n !== 1) {
      // the server would start one stream per choice; this client tracks one per generate()
      throw new RangeError("tokenrelay: params.n must be 1 here: call generate() once per choice");
    }
    const requestId = request.requestId ?? randomId("r");
    /** @type {Record<string, unknown>} */
    const frame = { type: "generate", request_id: requestId };
    if (request.messages != null) frame.messages = request.messages;
    else frame.prompt = request.prompt;
    if (request.params) frame.params = request.params;
    if (request.model != null) frame.model = request.model; // the gateway's default otherwise
    if (request.traceparent) frame.traceparent = request.traceparent; // docs/operations.md, Tracing
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
   * seq > `after` are delivered; `text` and `toolCalls` are what is already held up to `after`
   * (the fragments that follow add to those calls). Resuming a stream this machine already
   * tracks returns that stream.
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
      toolCalls: request.toolCalls ?? [],
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
        /** @type {{seq: number, text: string, fullText: string, logprobs?: object[],
         *   toolCalls?: object[]}} */
        const detail = { seq: f.seq, text, fullText: s.text };
        if (Array.isArray(f.logprobs)) detail.logprobs = f.logprobs; // only when asked for
        const deltas = Array.isArray(f.tool_calls) ? f.tool_calls : []; // params.tools
        if (deltas.length) detail.toolCalls = deltas;
        this._emit(s, "token", detail);
        for (const d of deltas) {
          const call = toolDelta(s, f.seq, d);
          if (call) this._emit(s, "tool-call", call);
        }
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
        s.toolCalls = Array.isArray(f.tool_calls) ? f.tool_calls : []; // authoritative
        const extra = { message: f.message, toolCalls: f.tool_calls };
        this._finish(s, f.finish_reason ?? "stop", f.usage ?? null, extra);
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
}
