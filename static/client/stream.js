// TokenRelayStream: one response stream of a TokenRelayClient, an EventTarget and an async
// iterable of its text, over the protocol's record of it (ProtocolStream); and
// TokenRelayError, what iterating a failed stream throws. Internal module: import these from
// tokenrelay-client.js.

/**
 * @typedef {import("../tokenrelay-protocol.js").ProtocolStream} ProtocolStream
 * @typedef {import("../tokenrelay-protocol.js").StreamState} StreamState
 * @typedef {import("../tokenrelay-protocol.js").Usage} Usage
 * @typedef {import("../tokenrelay-protocol.js").StreamError} StreamError
 * @typedef {import("../tokenrelay-protocol.js").ToolCall} ToolCall
 * @typedef {import("../tokenrelay-client.js").StreamResult} StreamResult
 * @typedef {import("./client.js").TokenRelayClient} TokenRelayClient
 */

/** @param {string} type @param {unknown} [detail] */
export function event(type, detail) {
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
 * - `token` `{seq, text, fullText}`: each seq exactly once, in order (with `params.tools`,
 *   `toolCalls`: the frame's deltas)
 * - `tool-call` `{seq, index, id, name, first, argumentsDelta, arguments}`: one per delta of a
 *   call (after its token event): its id and name, the fragment and its arguments so far
 * - `resumed` `{after}`: the stream was re-attached after a reconnect (or by resume())
 * - `done` `{finishReason, usage, text, seq, toolCalls?}`: finish reason stop, length,
 *   tool_calls, cancelled, error, expired
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

  /**
   * @returns {ToolCall[]} with `params.tools`: the calls so far (arguments as far as they
   *   came), in index order; the `done` frame's list once done
   */
  get toolCalls() {
    return this._record.toolCalls;
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
   * What to persist to resume this stream later with `client.resume(...)` (`toolCalls`: the
   * calls begun so far, when there are any).
   * @returns {{streamId: string|null, resumeToken: string|null, after: number, text: string,
   *   toolCalls?: ToolCall[]}}
   */
  toJSON() {
    /** @type {{streamId: string|null, resumeToken: string|null, after: number, text: string,
     *   toolCalls?: ToolCall[]}} */
    const saved = {
      streamId: this.streamId,
      resumeToken: this.resumeToken,
      after: this.lastSeq,
      text: this.text,
    };
    if (this.toolCalls.length) saved.toolCalls = this.toolCalls.map((c) => structuredClone(c));
    return saved;
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
