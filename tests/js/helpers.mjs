// Test doubles for static/tokenrelay-client.js: a manual clock, a fake WebSocket and a fake
// protocol v1 server that keeps each stream's events by seq (like the Redis stream log).

import { TokenRelayClient } from "../../static/tokenrelay-client.js";

/** A chat request for the tests. */
export const ask = { messages: [{ role: "user", content: "Hi" }], params: { temperature: 0 } };

/**
 * `makeClient` (a client on the fake socket, clock and window) and `connected` (one whose
 * first socket is open: hello received), over what `env()` returns when they are called:
 * a test file's current `{clock, server, win}`, renewed before each test.
 */
export function clientFactory(env) {
  function makeClient(extra = {}) {
    const { clock, win } = env();
    return new TokenRelayClient({
      endpoint: "http://gateway.test:8000/",
      WebSocket: FakeWebSocket,
      timers: clock,
      window: win,
      navigator: { onLine: true },
      random: () => 0.5,
      ...extra,
    });
  }
  function connected(extra = {}) {
    const client = makeClient(extra);
    client.connect();
    env().server.connect(FakeWebSocket.last());
    return client;
  }
  return { makeClient, connected };
}

/** A deterministic clock: timers run only when the test calls tick(). */
export class FakeClock {
  constructor() {
    this.now = 0;
    this.nextId = 1;
    /** @type {Map<number, {at: number, fn: Function}>} */
    this.timers = new Map();
    this.setTimeout = (fn, ms) => {
      const id = this.nextId++;
      this.timers.set(id, { at: this.now + Math.max(0, ms ?? 0), fn });
      return id;
    };
    this.clearTimeout = (id) => {
      this.timers.delete(id);
    };
  }

  /** Advance time by ms, running every timer that falls due, in order. */
  tick(ms) {
    const end = this.now + ms;
    for (;;) {
      let nextId = null;
      let next = null;
      for (const [id, t] of this.timers) {
        if (t.at <= end && (next === null || t.at < next.at)) {
          next = t;
          nextId = id;
        }
      }
      if (next === null) break;
      this.timers.delete(nextId);
      this.now = next.at;
      next.fn();
    }
    this.now = end;
  }

  /** Delays (ms from now) of the pending timers, sorted. */
  pending() {
    return [...this.timers.values()].map((t) => t.at - this.now).sort((a, b) => a - b);
  }
}

/** A WebSocket stand-in; `FakeWebSocket.instances` holds every socket created. */
export class FakeWebSocket {
  static instances = [];
  static CONNECTING = 0;
  static OPEN = 1;
  static CLOSING = 2;
  static CLOSED = 3;

  constructor(url) {
    this.url = url;
    this.readyState = 0;
    this.sent = [];
    this.closedWith = null;
    this.onopen = null;
    this.onmessage = null;
    this.onclose = null;
    this.onerror = null;
    /** @type {FakeServer|null} */
    this.server = null;
    FakeWebSocket.instances.push(this);
  }

  static reset() {
    FakeWebSocket.instances = [];
  }

  static last() {
    return FakeWebSocket.instances.at(-1);
  }

  send(data) {
    if (this.readyState !== 1) throw new Error("send on a socket that is not open");
    const frame = JSON.parse(data);
    this.sent.push(frame);
    this.server?.receive(this, frame);
  }

  close(code = 1000, reason = "") {
    if (this.readyState === 3) return;
    this.readyState = 3;
    this.closedWith = { code, reason };
    this.server?.detach(this);
  }

  // --- what the "server side" does to the socket ---
  accept(hello = true) {
    this.readyState = 1;
    this.onopen?.({});
    if (hello) this.push({ type: "hello", protocol: 1, heartbeat_s: 20 });
  }

  push(frame) {
    if (this.readyState !== 1) return;
    this.onmessage?.({ data: JSON.stringify(frame) });
  }

  /** The connection fails or drops (network or server). */
  drop(code = 1006, reason = "") {
    const wasOpen = this.readyState !== 3;
    this.readyState = 3;
    this.server?.detach(this);
    if (wasOpen) this.onclose?.({ code, reason, wasClean: false });
  }

  sentOfType(type) {
    return this.sent.filter((f) => f.type === type);
  }
}

/**
 * A protocol v1 server over FakeWebSockets. Streams are logs of events by seq (tokens 1..n-1,
 * done n). `emit(streamId, n)` produces the next n tokens; attached sockets get them live.
 * `replayOverlap` makes resume replay that many events before `after` (duplicates the client
 * must drop).
 */
export class FakeServer {
  /**
   * `chunks`: each token's text, or the token frame's fields (`{text, tool_calls}`); `end`: the
   * fields of a `done` that is no cancel (its `finish_reason`, `tool_calls`).
   */
  constructor({ chunks, replayOverlap = 0, end = { finish_reason: "stop" } } = {}) {
    this.chunks = chunks ?? ["Hel", "lo", ", ", "wor", "ld", "!"];
    this.end = end;
    this.replayOverlap = replayOverlap;
    /** @type {Map<string, {events: object[], sockets: Set<FakeWebSocket>, token: string, next: number, cancelled: boolean}>} */
    this.streams = new Map();
    this.received = [];
    this.counter = 0;
  }

  connect(ws, { hello = true } = {}) {
    ws.server = this;
    ws.accept(hello);
  }

  detach(ws) {
    for (const s of this.streams.values()) s.sockets.delete(ws);
  }

  receive(ws, f) {
    this.received.push(f);
    if (f.type === "ping") ws.push({ type: "pong" });
    else if (f.type === "generate") {
      const id = `stream${String(++this.counter).padStart(12, "0")}`;
      const token = `tok-${id}`;
      this.streams.set(id, { events: [], sockets: new Set([ws]), token, next: 0, cancelled: false });
      ws.push({
        type: "started",
        request_id: f.request_id,
        stream_id: id,
        resume_token: token,
        prompt_tokens: 5,
      });
    } else if (f.type === "resume") {
      const s = this.streams.get(f.stream_id);
      if (!s || s.token !== f.resume_token) {
        ws.push({ type: "error", code: "not_found", message: "no such stream", stream_id: f.stream_id });
        return;
      }
      ws.push({ type: "resumed", stream_id: f.stream_id, after: f.after });
      const from = Math.max(0, f.after - this.replayOverlap);
      for (const e of s.events) if (e.seq > from) ws.push(e);
      if (!this.finished(f.stream_id)) s.sockets.add(ws);
    } else if (f.type === "cancel") {
      const s = this.streams.get(f.stream_id);
      if (!s) return;
      s.cancelled = true;
      ws.push({ type: "cancelled", stream_id: f.stream_id, state: "cancelling", finish_reason: null });
    }
  }

  finished(id) {
    const s = this.streams.get(id);
    return !!s && s.events.length > 0 && s.events.at(-1).type === "done";
  }

  /** The full text the stream will produce. */
  fullText() {
    return this.chunks.map((c) => (typeof c === "string" ? c : c.text)).join("");
  }

  /** Produce the next n events of stream `id` (tokens, then done). */
  emit(id, n = 1) {
    const s = this.streams.get(id);
    for (let i = 0; i < n && !this.finished(id); i++) {
      const seq = s.events.length + 1;
      let e;
      if (s.cancelled) {
        e = { type: "done", stream_id: id, seq, finish_reason: "cancelled", usage: { prompt_tokens: 5, completion_tokens: seq - 1 } };
      } else if (s.next < this.chunks.length) {
        const c = this.chunks[s.next++];
        e = { type: "token", stream_id: id, seq, ...(typeof c === "string" ? { text: c } : c) };
      } else {
        e = { type: "done", stream_id: id, seq, ...this.end, usage: { prompt_tokens: 5, completion_tokens: seq - 1 } };
      }
      s.events.push(e);
      for (const ws of s.sockets) ws.push(e);
    }
  }

  /** Produce every remaining event. */
  finish(id) {
    while (!this.finished(id)) this.emit(id, 1);
  }

  onlyStreamId() {
    return [...this.streams.keys()].at(-1);
  }
}

/** An EventTarget standing in for `window` (online/offline events). */
export function fakeWindow() {
  return new EventTarget();
}

/** Collect the `detail` of every `type` event of `target`. */
export function record(target, ...types) {
  const log = [];
  for (const type of types) {
    target.addEventListener(type, (e) => log.push({ type, ...(e.detail ?? {}) }));
  }
  return log;
}

/**
 * A FakeServer answer (`new FakeServer(toolAnswer())`): some text, then a call streamed as
 * `tool_calls` deltas (docs/protocol.md, `token`; a frame of markup alone has neither), and
 * the `done` frame listing it whole.
 */
export function toolAnswer() {
  const head = { index: 0, id: "call_1", type: "function", function: { name: "get_weather", arguments: "" } };
  const more = (args) => ({ text: "", tool_calls: [{ index: 0, function: { arguments: args } }] });
  const call = { id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"city": "Paris"}' } };
  return {
    chunks: ["Let me check.", { text: "", tool_calls: [head] }, more('{"city": '), { text: "" }, more('"Paris"}')],
    end: { finish_reason: "tool_calls", tool_calls: [call] },
  };
}
