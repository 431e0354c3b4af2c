// ProtocolStream: tokenrelay-protocol.js's record of one stream (sans I/O). Internal module:
// import it from tokenrelay-protocol.js.

/**
 * @typedef {import("../tokenrelay-protocol.js").StreamState} StreamState
 * @typedef {import("../tokenrelay-protocol.js").Usage} Usage
 * @typedef {import("../tokenrelay-protocol.js").StreamError} StreamError
 * @typedef {import("../tokenrelay-protocol.js").ToolCall} ToolCall
 * @typedef {import("../tokenrelay-protocol.js").ToolCallEvent} ToolCallEvent
 */

/**
 * The protocol's record of one stream. The I/O layer reads it; only {@link ClientProtocol}
 * changes it.
 */
export class ProtocolStream {
  /**
   * @param {number} id local handle (timer keys use it)
   * @param {{requestId?: string|null, frame?: Record<string, unknown>|null,
   *   streamId?: string|null, resumeToken?: string|null, lastSeq?: number,
   *   text?: string, toolCalls?: ToolCall[]}} init
   */
  constructor(id, init) {
    /** @readonly */ this.id = id;
    /** @type {string|null} */ this.requestId = init.requestId ?? null;
    /** @type {string|null} */ this.streamId = init.streamId ?? null;
    /** @type {string|null} secret needed to resume or cancel from another socket */
    this.resumeToken = init.resumeToken ?? null;
    /** @type {number} seq of the last event delivered */ this.lastSeq = init.lastSeq ?? 0;
    /** @type {string} all text delivered so far */ this.text = init.text ?? "";
    /**
     * @type {ToolCall[]} with `params.tools`: the calls so far (arguments as far as they came),
     * in index order; the `done` frame's list once done
     */
    this.toolCalls = [];
    for (const [index, call] of (init.toolCalls ?? []).entries()) {
      toolDelta(this, 0, { index, id: call.id, function: call.function });
    }
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

/** @type {WeakMap<ProtocolStream, Map<number, ToolCall>>} each stream's calls by index */
const CALLS = new WeakMap();

/**
 * Add one entry of a token frame's `tool_calls` (OpenAI's `delta.tool_calls`) to its call in
 * `s.toolCalls`.
 * @param {ProtocolStream} s @param {number} seq @param {any} d
 * @returns {ToolCallEvent|null} what the `tool-call` event says (null: not an entry)
 */
export function toolDelta(s, seq, d) {
  if (!d || typeof d !== "object" || !Number.isInteger(d.index) || d.index < 0) return null;
  const fn = d.function && typeof d.function === "object" ? d.function : {};
  const argumentsDelta = typeof fn.arguments === "string" ? fn.arguments : "";
  let calls = CALLS.get(s);
  if (calls === undefined) CALLS.set(s, (calls = new Map()));
  let call = calls.get(d.index);
  const first = call === undefined;
  if (call === undefined) {
    const name = typeof fn.name === "string" ? fn.name : "";
    const id = typeof d.id === "string" ? d.id : "";
    call = { id, type: /** @type {const} */ ("function"), function: { name, arguments: "" } };
    calls.set(d.index, call);
    s.toolCalls = [...calls].sort((a, b) => a[0] - b[0]).map(([, c]) => c);
  }
  call.function.arguments += argumentsDelta;
  const { id, function: { name, arguments: args } } = call;
  return { seq, index: d.index, id, name, first, argumentsDelta, arguments: args };
}
