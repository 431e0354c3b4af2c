// Unit tests of static/tokenrelay-protocol.js, the sans-I/O state machine under the JS client:
// frames, calls and timer expirations in, actions out. `node --test tests/js/`.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, test } from "node:test";

import {
  backoffDelay,
  ClientProtocol,
  PROTOCOL_DEFAULTS,
  PROTOCOL_VERSION,
  RETRYABLE_CODES,
  retryDelay,
} from "../../static/tokenrelay-protocol.js";

const ask = { messages: [{ role: "user", content: "Hi" }], params: { temperature: 0 } };
const half = () => 0.5;

/** A machine with a deterministic jitter, and helpers to read what it asks for. */
function machine(options = {}) {
  return new ClientProtocol({ random: half, ...options });
}

/** The frames it wants sent, as [conn, frame] pairs (consumes every pending action). */
function sends(p) {
  return p
    .takeActions()
    .filter((a) => a.type === "send")
    .map((a) => [a.conn, a.frame]);
}

/** Every pending action, consumed. */
function actions(p) {
  return p.takeActions();
}

function streamEvents(list, name) {
  return list.filter((a) => a.type === "stream" && (!name || a.name === name));
}

/** Open connection `conn`, start a generate on it and answer `started`. */
function started(p, conn = 1, { requestId = "r1", streamId = "S1" } = {}) {
  if (p.primary !== conn) p.opened(conn);
  const s = p.generate({ ...ask, requestId });
  p.receive(conn, {
    type: "started",
    request_id: requestId,
    stream_id: streamId,
    resume_token: `tok-${streamId}`,
    prompt_tokens: 5,
  });
  p.takeActions();
  return s;
}

const token = (seq, text, stream = "S1") => ({ type: "token", stream_id: stream, seq, text });
const done = (seq, reason = "stop", stream = "S1") => ({
  type: "done",
  stream_id: stream,
  seq,
  finish_reason: reason,
  usage: { prompt_tokens: 5, completion_tokens: seq - 1 },
});

describe("the module is sans I/O", () => {
  /** tokenrelay-protocol.js and every module it imports (static/client/...), by URL. */
  const sources = () => {
    const seen = new Map();
    const visit = (url) => {
      if (seen.has(url.href)) return;
      const src = readFileSync(url, "utf8");
      seen.set(url.href, src);
      for (const [, spec] of src.matchAll(/^\s*(?:import|export)\s[^;]*?\sfrom\s*"(\.[^"]+)"/gm)) {
        visit(new URL(spec, url));
      }
    };
    visit(new URL("../../static/tokenrelay-protocol.js", import.meta.url));
    return seen;
  };

  test("no socket, no timer, no global event in the source", () => {
    const all = sources();
    assert.ok(all.size >= 4, `the protocol's modules: ${[...all.keys()]}`);
    for (const [url, text] of all) {
      const src = text
        .split("\n")
        .filter((line) => !line.trim().startsWith("//") && !line.trim().startsWith("*"))
        .join("\n");
      const name = url.slice(url.indexOf("/static/") + 1);
      for (const word of ["setTimeout", "setInterval", "WebSocket(", "addEventListener", "fetch(", "Date.now"]) {
        assert.ok(!src.includes(word), `${name} uses ${word}`);
      }
      assert.ok(!/from\s*"\.\.?\/tokenrelay-client\.js"/.test(src), `${name} imports the client`);
    }
  });

  test("constants", () => {
    assert.equal(PROTOCOL_VERSION, 1);
    assert.deepEqual([...RETRYABLE_CODES], ["unavailable", "overloaded", "rate_limited"]);
    assert.ok(Object.isFrozen(PROTOCOL_DEFAULTS));
    assert.equal(PROTOCOL_DEFAULTS.retryLimit, 8);
  });
});

describe("generate", () => {
  test("waits for a connection, then sends exactly one generate frame", () => {
    const p = machine();
    const s = p.generate({ ...ask, requestId: "r1" });
    assert.equal(s.state, "pending");
    assert.deepEqual(actions(p), []);
    p.opened(7);
    assert.deepEqual(sends(p), [
      [7, { type: "generate", request_id: "r1", messages: ask.messages, params: ask.params }],
    ]);
    assert.equal(s.conn, 7);
    assert.equal(s.everSent, true);
  });

  test("goes out at once on an open connection; prompt instead of messages", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate({ prompt: "Once upon" });
    const [[conn, frame]] = sends(p);
    assert.equal(conn, 1);
    assert.equal(frame.prompt, "Once upon");
    assert.match(s.requestId, /^r-[0-9a-f]{18}$/);
    assert.equal(frame.request_id, s.requestId);
    assert.equal("params" in frame, false);
  });

  test("needs messages or a prompt", () => {
    assert.throws(() => machine().generate({}), TypeError);
    assert.throws(() => machine().generate(null), TypeError);
    // n > 1 would start several streams for one generate(): refused, not half-tracked
    assert.throws(() => machine().generate({ ...ask, params: { n: 2 } }), RangeError);
    assert.ok(machine().generate({ ...ask, params: { n: 1 } }));
  });

  test("a traceparent goes out with the generate frame", () => {
    const p = machine();
    p.opened(1);
    const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    p.generate({ ...ask, requestId: "r1", traceparent: tp });
    const [[, frame]] = sends(p);
    assert.equal(frame.traceparent, tp);
  });

  test("model goes out with the generate frame, also when it is sent again", () => {
    const p = machine();
    p.opened(1);
    p.generate({ ...ask, requestId: "r1", model: "tiny-chat" });
    assert.deepEqual(sends(p), [
      [1, { type: "generate", request_id: "r1", messages: ask.messages, params: ask.params, model: "tiny-chat" }],
    ]);
    p.closed(1); // before `started`: the generate goes out again on the next connection
    p.opened(2);
    const [[conn, frame]] = sends(p);
    assert.equal(conn, 2);
    assert.equal(frame.model, "tiny-chat");
    // none given: no model field, the gateway's default model answers
    p.generate({ ...ask, requestId: "r2" });
    const [[, plain]] = sends(p);
    assert.equal("model" in plain, false);
  });

  test("a tool round trip: tool_calls and tool messages go out as given", () => {
    const p = machine();
    p.opened(1);
    const tools = [{ type: "function", function: { name: "weather", parameters: { type: "object" } } }];
    p.generate({ messages: [{ role: "user", content: "Weather in Paris?" }], params: { tools }, requestId: "r1", model: "m" });
    p.receive(1, { type: "started", request_id: "r1", stream_id: "S1", resume_token: "t", prompt_tokens: 5 });
    const calls = [
      { id: "call_1", type: "function", function: { name: "weather", arguments: '{"city":"Paris"}' } },
    ];
    p.receive(1, { ...done(1, "tool_calls"), tool_calls: calls });
    const [ev] = streamEvents(actions(p), "done");
    const messages = [
      { role: "user", content: "Weather in Paris?" },
      { role: "assistant", content: null, tool_calls: ev.detail.toolCalls },
      { role: "tool", tool_call_id: ev.detail.toolCalls[0].id, content: '{"temp":21}' },
    ];
    p.generate({ messages, params: { tools }, requestId: "r2", model: "m" });
    assert.deepEqual(sends(p), [
      [1, { type: "generate", request_id: "r2", messages, params: { tools }, model: "m" }],
    ]);
  });

  test("a done frame's tool_calls reach the done event as toolCalls", () => {
    const p = machine();
    started(p);
    const calls = [{ id: "call_1", type: "function", function: { name: "f", arguments: "{}" } }];
    p.receive(1, { ...done(1, "tool_calls"), tool_calls: calls });
    const [ev] = streamEvents(actions(p), "done");
    assert.equal(ev.detail.finishReason, "tool_calls");
    assert.deepEqual(ev.detail.toolCalls, calls);
  });

  test("already cancelled (an aborted signal): ends at once, nothing is ever sent", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate(ask, { cancelled: true });
    const list = actions(p);
    assert.deepEqual(list.filter((a) => a.type === "send"), []);
    assert.deepEqual(streamEvents(list).map((a) => [a.name, a.detail.finishReason, a.detail.local]), [
      ["done", "cancelled", true],
    ]);
    assert.equal(s.closed, true);
    p.closed(1);
    p.opened(2);
    assert.deepEqual(sends(p), []);
  });
});

describe("tokens, dedupe by seq and gaps", () => {
  test("started, tokens in order, done", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate({ ...ask, requestId: "r1" });
    p.takeActions();
    p.receive(1, { type: "started", request_id: "r1", stream_id: "S1", resume_token: "T", prompt_tokens: 3 });
    p.receive(1, token(1, "Hel"));
    p.receive(1, token(2, "lo"));
    p.receive(1, done(3));
    const list = streamEvents(actions(p));
    assert.deepEqual(
      list.map((a) => [a.name, a.detail]),
      [
        ["started", { streamId: "S1", resumeToken: "T", promptTokens: 3 }],
        ["token", { seq: 1, text: "Hel", fullText: "Hel" }],
        ["token", { seq: 2, text: "lo", fullText: "Hello" }],
        ["done", { finishReason: "stop", usage: { prompt_tokens: 5, completion_tokens: 2 }, text: "Hello", seq: 3 }],
      ],
    );
    assert.equal(s.text, "Hello");
    assert.equal(s.lastSeq, 3);
    assert.equal(s.state, "done");
    assert.equal(s.finishReason, "stop");
    assert.deepEqual(p.streams, []);
  });

  test("a token frame's logprobs reach its event, and only when present", () => {
    const p = machine();
    started(p);
    const lp = [{ token: "Hi", logprob: -0.25, bytes: [72, 105], top_logprobs: [] }];
    p.receive(1, { ...token(1, "Hi"), logprobs: lp });
    p.receive(1, token(2, "!"));
    const list = streamEvents(actions(p), "token");
    assert.deepEqual(list[0].detail, { seq: 1, text: "Hi", fullText: "Hi", logprobs: lp });
    assert.deepEqual(list[1].detail, { seq: 2, text: "!", fullText: "Hi!" });
  });

  test("a token frame's tool_calls add up per call, a tool-call event each; done has the last word", () => {
    const p = machine();
    const s = started(p);
    const head = (index, id, name) => ({ index, id, type: "function", function: { name, arguments: "" } });
    const more = (index, args) => ({ index, function: { arguments: args } });
    const call = (id, name, args) => ({ id, type: "function", function: { name, arguments: args } });
    p.receive(1, { ...token(1, ""), tool_calls: [head(0, "c0", "f")] });
    p.receive(1, { ...token(2, ""), tool_calls: [more(0, '{"a":')] });
    assert.deepEqual(s.toolCalls, [call("c0", "f", '{"a":')]); // the call so far
    p.receive(1, { ...token(3, ""), tool_calls: [more(0, " 1}"), head(1, "c1", "g")] });
    p.receive(1, { ...token(3, ""), tool_calls: [more(0, " 1}")] }); // a repeat: dropped
    p.receive(1, { ...token(4, ""), tool_calls: [more(1, "{}")] });
    const list = actions(p);
    assert.deepEqual(streamEvents(list, "token")[1].detail.toolCalls, [more(0, '{"a":')]);
    const ev = (seq, index, id, name, first, argumentsDelta, args) =>
      ({ seq, index, id, name, first, argumentsDelta, arguments: args });
    assert.deepEqual(streamEvents(list, "tool-call").map((a) => a.detail), [
      ev(1, 0, "c0", "f", true, "", ""),
      ev(2, 0, "c0", "f", false, '{"a":', '{"a":'),
      ev(3, 0, "c0", "f", false, " 1}", '{"a": 1}'),
      ev(3, 1, "c1", "g", true, "", ""),
      ev(4, 1, "c1", "g", false, "{}", "{}"),
    ]);
    // each tool-call event follows the token event of its frame
    assert.deepEqual(list.filter((a) => a.type === "stream").map((a) => a.name).slice(0, 4),
      ["token", "tool-call", "token", "tool-call"]);
    assert.deepEqual(s.toolCalls, [call("c0", "f", '{"a": 1}'), call("c1", "g", "{}")]);
    p.receive(1, { ...done(5, "tool_calls"), tool_calls: [call("c0", "f", '{"a": 1}')] });
    assert.deepEqual(s.toolCalls, [call("c0", "f", '{"a": 1}')]); // c1 was cut off
  });

  test("resume() with the calls held goes on from them", () => {
    const p = machine();
    const held = [{ id: "c0", type: "function", function: { name: "f", arguments: '{"a"' } }];
    const s = p.resume({ streamId: "S1", resumeToken: "T", after: 3, toolCalls: held });
    p.opened(1);
    p.receive(1, { type: "resumed", stream_id: "S1", after: 3 });
    p.receive(1, { ...token(4, ""), tool_calls: [{ index: 0, function: { arguments: ": 1}" } }] });
    const [ev] = streamEvents(actions(p), "tool-call");
    assert.equal(ev.detail.arguments, '{"a": 1}');
    assert.equal(ev.detail.first, false);
    assert.equal(s.toolCalls[0].function.arguments, '{"a": 1}');
    assert.equal(held[0].function.arguments, '{"a"'); // the caller's copy is left alone
  });

  test("a repeated seq is dropped and counted", () => {
    const p = machine();
    const s = started(p);
    for (const f of [token(1, "a"), token(1, "a"), token(2, "b"), token(1, "a"), token(2, "b")]) {
      p.receive(1, f);
    }
    assert.equal(streamEvents(actions(p), "token").length, 2);
    assert.equal(s.text, "ab");
    assert.equal(p.stats.duplicates, 3);
  });

  test("a gap asks for a replay from the last seq once, and skips nothing", () => {
    const p = machine();
    const s = started(p);
    p.receive(1, token(1, "a"));
    p.takeActions();
    p.receive(1, token(3, "c")); // seq 2 was lost
    p.receive(1, token(4, "d")); // still missing: no second resume
    assert.deepEqual(sends(p), [[1, { type: "resume", stream_id: "S1", resume_token: "tok-S1", after: 1 }]]);
    assert.equal(p.stats.gaps, 2);
    assert.equal(s.text, "a");
    p.receive(1, { type: "resumed", stream_id: "S1", after: 1 });
    for (const f of [token(2, "b"), token(3, "c"), token(4, "d"), done(5)]) p.receive(1, f);
    assert.equal(s.text, "abcd");
    assert.equal(s.resumes, 1);
    assert.equal(s.state, "done");
  });

  test("a done ahead of missing tokens replays instead of ending early", () => {
    const p = machine();
    const s = started(p);
    p.receive(1, done(4));
    assert.equal(s.closed, false);
    assert.deepEqual(sends(p), [[1, { type: "resume", stream_id: "S1", resume_token: "tok-S1", after: 0 }]]);
  });

  test("frames for unknown streams, tokens without seq and unknown types are ignored", () => {
    const p = machine();
    const s = started(p);
    p.receive(1, token(1, "x", "other"));
    p.receive(1, { type: "token", stream_id: "S1", text: "no seq" });
    p.receive(1, { type: "future-thing", stream_id: "S1" });
    p.receive(1, { type: "started", request_id: "r1", stream_id: "S2", resume_token: "t" }); // second started
    p.receive(1, null);
    p.receive(1, { type: "pong" });
    assert.deepEqual(actions(p), []);
    assert.equal(s.streamId, "S1");
  });
});

describe("resume offsets", () => {
  test("a lost connection resumes every stream from its last seq on the next one", () => {
    const p = machine();
    const a = started(p, 1, { requestId: "ra", streamId: "A" });
    const b = started(p, 1, { requestId: "rb", streamId: "B" });
    p.receive(1, token(1, "a1", "A"));
    p.receive(1, token(2, "a2", "A"));
    p.receive(1, token(1, "b1", "B"));
    p.takeActions();
    p.closed(1);
    assert.deepEqual(actions(p), []); // nothing to send anywhere
    assert.equal(a.conn, null);
    p.opened(2);
    assert.deepEqual(sends(p), [
      [2, { type: "resume", stream_id: "A", resume_token: "tok-A", after: 2 }],
      [2, { type: "resume", stream_id: "B", resume_token: "tok-B", after: 1 }],
    ]);
    // the server replays with an overlap: the repeats are dropped
    p.receive(2, { type: "resumed", stream_id: "A", after: 2 });
    for (const f of [token(1, "a1", "A"), token(2, "a2", "A"), token(3, "a3", "A"), done(4, "stop", "A")]) {
      p.receive(2, f);
    }
    assert.equal(a.text, "a1a2a3");
    assert.equal(a.resumes, 1);
    assert.equal(p.stats.resumes, 1);
    assert.equal(p.stats.duplicates, 2);
    assert.equal(b.closed, false);
  });

  test("a generate whose started never came is sent again, same request id", () => {
    const p = machine();
    p.opened(1);
    p.generate({ ...ask, requestId: "r9" });
    p.takeActions();
    p.closed(1);
    p.opened(2);
    assert.deepEqual(sends(p).map(([c, f]) => [c, f.type, f.request_id]), [[2, "generate", "r9"]]);
  });

  test("resume() starts from `after` with the text held; the same stream twice is one stream", () => {
    const p = machine();
    const s = p.resume({ streamId: "S1", resumeToken: "T", after: 2, text: "Hello" });
    assert.equal(s.state, "streaming");
    assert.equal(s.text, "Hello");
    assert.equal(p.resume({ streamId: "S1", resumeToken: "T", after: 0 }), s);
    p.opened(1);
    assert.deepEqual(sends(p), [[1, { type: "resume", stream_id: "S1", resume_token: "T", after: 2 }]]);
    p.receive(1, { type: "resumed", stream_id: "S1", after: 2 });
    p.receive(1, token(3, ", world"));
    assert.equal(s.text, "Hello, world");
    assert.throws(() => p.resume({ streamId: "S1" }), TypeError);
  });

  test("a closed connection that never opened changes nothing", () => {
    const p = machine();
    const s = started(p);
    p.closed(99);
    assert.equal(s.conn, 1);
    assert.deepEqual(actions(p), []);
  });
});

describe("cancel", () => {
  test("a started stream: cancel frame with the token, a cancel timer, cleared by done", () => {
    const p = machine({ cancelTimeout: 3000 });
    const s = started(p);
    p.cancel(s);
    p.cancel(s); // twice: the frame again, one timer
    const list = actions(p);
    assert.deepEqual(
      list.filter((a) => a.type === "send").map((a) => a.frame),
      [
        { type: "cancel", stream_id: "S1", resume_token: "tok-S1" },
        { type: "cancel", stream_id: "S1", resume_token: "tok-S1" },
      ],
    );
    assert.deepEqual(list.filter((a) => a.type === "timer"), [{ type: "timer", key: `cancel:${s.id}`, delay: 3000 }]);
    p.receive(1, { type: "cancelled", stream_id: "S1", state: "cancelling", finish_reason: null });
    p.receive(1, done(1, "cancelled"));
    const after = actions(p);
    assert.deepEqual(streamEvents(after).map((a) => a.name), ["cancel-ack", "done"]);
    assert.deepEqual(after.filter((a) => a.type === "clear-timer"), [{ type: "clear-timer", key: `cancel:${s.id}` }]);
    assert.equal(s.finishReason, "cancelled");
  });

  test("no answer: the timer ends the stream locally", () => {
    const p = machine();
    const s = started(p);
    p.receive(1, token(1, "a"));
    p.cancel(s);
    p.takeActions();
    p.timer(`cancel:${s.id}`);
    const [ev] = streamEvents(actions(p));
    assert.equal(ev.name, "done");
    assert.equal(ev.detail.finishReason, "cancelled");
    assert.equal(ev.detail.local, true);
    assert.equal(s.text, "a");
  });

  test("never sent: ends locally with no frame", () => {
    const p = machine();
    const s = p.generate(ask);
    p.cancel(s);
    assert.equal(s.finishReason, "cancelled");
    p.opened(1);
    assert.deepEqual(sends(p), []);
  });

  test("generate out, no started yet: the cancel follows the started", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate({ ...ask, requestId: "r1" });
    p.takeActions();
    p.cancel(s);
    assert.deepEqual(sends(p), []);
    p.receive(1, { type: "started", request_id: "r1", stream_id: "S1", resume_token: "T" });
    assert.deepEqual(sends(p), [[1, { type: "cancel", stream_id: "S1", resume_token: "T" }]]);
  });

  test("generate out on a socket that died before started: ends locally, not sent again", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate(ask);
    p.closed(1);
    p.takeActions();
    p.cancel(s);
    assert.equal(s.finishReason, "cancelled");
    p.opened(2);
    assert.deepEqual(sends(p), []);
  });

  test("while disconnected: resume then cancel on the next connection", () => {
    const p = machine();
    const s = started(p);
    p.receive(1, token(1, "a"));
    p.closed(1);
    p.takeActions();
    p.cancel(s);
    assert.deepEqual(sends(p), []);
    p.opened(2);
    assert.deepEqual(sends(p).map(([c, f]) => [c, f.type, f.after]), [
      [2, "resume", 1],
      [2, "cancel", undefined],
    ]);
  });

  test("pause() drops the cancel timers", () => {
    const p = machine();
    const s = started(p);
    p.cancel(s);
    p.takeActions();
    p.pause();
    assert.deepEqual(actions(p), [{ type: "clear-timer", key: `cancel:${s.id}` }]);
  });
});

describe("errors", () => {
  test("a non-retryable error fails its stream only", () => {
    const p = machine();
    p.opened(1);
    const bad = p.generate({ ...ask, requestId: "bad" });
    const good = p.generate({ ...ask, requestId: "good" });
    p.takeActions();
    p.receive(1, { type: "error", code: "bad_request", message: "nope", request_id: "bad" });
    assert.deepEqual(streamEvents(actions(p)).map((a) => [a.name, a.detail]), [
      ["error", { code: "bad_request", message: "nope" }],
    ]);
    assert.deepEqual(bad.error, { code: "bad_request", message: "nope" });
    assert.equal(bad.state, "error");
    assert.equal(good.state, "pending");
  });

  test("not_found on a resume fails the stream", () => {
    const p = machine();
    const s = p.resume({ streamId: "gone", resumeToken: "T", after: 3 });
    p.opened(1);
    p.receive(1, { type: "error", code: "not_found", message: "no such stream", stream_id: "gone" });
    assert.equal(s.error.code, "not_found");
  });

  test("an error about nothing of ours goes to the client", () => {
    const p = machine();
    p.opened(1);
    const frame = { type: "error", code: "bad_request", message: "frame is not valid JSON" };
    p.receive(1, frame);
    assert.deepEqual(actions(p), [
      { type: "client", name: "error", detail: { code: "bad_request", message: frame.message, frame } },
    ]);
  });

  test("fail() ends every stream", () => {
    const p = machine();
    const a = p.generate(ask);
    const b = p.resume({ streamId: "S", resumeToken: "T" });
    p.fail("forbidden", "policy");
    assert.deepEqual([a.error, b.error], [
      { code: "forbidden", message: "policy" },
      { code: "forbidden", message: "policy" },
    ]);
    assert.deepEqual(p.streams, []);
  });
});

describe("retries", () => {
  test("retryDelay = retry_after + the jittered backoff", () => {
    const o = { backoffInitial: 100, backoffMax: 1000, backoffFactor: 2, backoffJitter: 0.5 };
    assert.equal(retryDelay(1, null, o, () => 0), 200);
    assert.equal(retryDelay(1, 2, o, () => 0), 2200);
    assert.equal(retryDelay(1, 2, o, () => 0.999999), 2100);
    assert.equal(retryDelay(6, 0, o, () => 0), 1000);
    for (let i = 0; i < 200; i++) {
      const d = retryDelay(2, 3, o);
      assert.ok(d >= 3200 && d <= 3400, `delay ${d}`);
    }
    assert.equal(backoffDelay(0, o, () => 0), 100);
  });

  for (const code of RETRYABLE_CODES) {
    test(`${code} on a generate: sent again after the delay, same request id`, () => {
      const p = machine();
      p.opened(1);
      const s = p.generate({ ...ask, requestId: "r1" });
      p.takeActions();
      p.receive(1, { type: "error", code, message: "later", request_id: "r1", retry_after: 2 });
      const list = actions(p);
      const delay = retryDelay(1, 2, PROTOCOL_DEFAULTS, half);
      assert.deepEqual(list, [{ type: "timer", key: `retry:${s.id}`, delay }]);
      assert.equal(delay, 2000 + 375);
      assert.equal(s.state, "pending");
      assert.equal(s.waiting, true);
      p.timer(`retry:${s.id}`);
      assert.deepEqual(sends(p).map(([c, f]) => [c, f.type, f.request_id]), [[1, "generate", "r1"]]);
      assert.equal(p.stats.retries, 1);
      p.receive(1, { type: "started", request_id: "r1", stream_id: "S1", resume_token: "T" });
      assert.equal(s.retries, 0); // success starts the count over
    });
  }

  test("the delays back off and the limit fails the stream with the last error", () => {
    const p = machine({ retryLimit: 3 });
    p.opened(1);
    const s = p.generate({ ...ask, requestId: "r1" });
    p.takeActions();
    const delays = [];
    for (let i = 0; i < 3; i++) {
      p.receive(1, { type: "error", code: "overloaded", message: "busy", request_id: "r1", retry_after: 1 });
      const [timer] = actions(p);
      delays.push(timer.delay);
      p.timer(timer.key);
      p.takeActions();
    }
    assert.deepEqual(delays, [1375, 1750, 2500]);
    p.receive(1, { type: "error", code: "overloaded", message: "busy", request_id: "r1", retry_after: 1 });
    assert.deepEqual(s.error, { code: "overloaded", message: "busy", retryAfter: 1 });
    assert.equal(p.stats.retries, 3);
  });

  test("retryLimit 0 fails at once; a retry_after over retryMaxDelay fails at once", () => {
    const p = machine({ retryLimit: 0 });
    p.opened(1);
    const a = p.generate({ ...ask, requestId: "a" });
    p.receive(1, { type: "error", code: "unavailable", message: "no worker", request_id: "a" });
    assert.deepEqual(a.error, { code: "unavailable", message: "no worker" });
    const q = machine({ retryMaxDelay: 10_000 });
    q.opened(1);
    const b = q.generate({ ...ask, requestId: "b" });
    q.receive(1, { type: "error", code: "rate_limited", message: "slow down", request_id: "b", retry_after: 60 });
    assert.deepEqual(b.error, { code: "rate_limited", message: "slow down", retryAfter: 60 });
  });

  test("a retryable error on a running stream retries the resume from the last seq", () => {
    const p = machine();
    const s = started(p);
    p.receive(1, token(1, "a"));
    p.receive(1, token(2, "b"));
    p.takeActions();
    p.receive(1, { type: "error", code: "unavailable", message: "store down", stream_id: "S1" });
    const [timer] = actions(p);
    assert.equal(timer.type, "timer");
    assert.equal(s.conn, null); // that socket no longer delivers the stream
    p.timer(timer.key);
    assert.deepEqual(sends(p), [[1, { type: "resume", stream_id: "S1", resume_token: "tok-S1", after: 2 }]]);
  });

  test("a retry that falls due with no connection goes out on the next; reconnects wait for it", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate({ ...ask, requestId: "r1" });
    p.receive(1, { type: "error", code: "overloaded", message: "busy", request_id: "r1", retry_after: 5 });
    p.takeActions();
    p.closed(1);
    p.opened(2); // the refusal's retry_after still holds
    assert.deepEqual(sends(p), []);
    p.closed(2);
    p.timer(`retry:${s.id}`);
    assert.deepEqual(sends(p), []);
    p.opened(3);
    assert.deepEqual(sends(p).map(([c, f]) => [c, f.type]), [[3, "generate"]]);
  });

  test("worker_ready sends the generates waiting for their retry at once", () => {
    const p = machine();
    p.opened(1);
    p.receive(1, { type: "hello", protocol: 1, worker_ready: false });
    const s = p.generate({ ...ask, requestId: "r1" });
    p.receive(1, { type: "error", code: "unavailable", message: "no worker", request_id: "r1" });
    assert.equal(p.workerReady, false);
    p.takeActions();
    p.receive(1, { type: "notice", code: "worker_ready", message: "" });
    const list = actions(p);
    assert.deepEqual(list.slice(0, 3), [
      { type: "client", name: "readiness", detail: { ready: true } },
      { type: "clear-timer", key: `retry:${s.id}` },
      { type: "send", conn: 1, frame: s.frame },
    ]);
    assert.equal(p.workerReady, true);
  });

  test("cancel while waiting for a retry ends the stream locally and drops the timer", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate({ ...ask, requestId: "r1" });
    p.receive(1, { type: "error", code: "rate_limited", message: "wait", request_id: "r1", retry_after: 1 });
    p.takeActions();
    p.cancel(s);
    const list = actions(p);
    assert.deepEqual(list.filter((a) => a.type === "clear-timer"), [{ type: "clear-timer", key: `retry:${s.id}` }]);
    assert.equal(s.finishReason, "cancelled");
    p.timer(`retry:${s.id}`); // a late timer does nothing
    assert.deepEqual(actions(p), []);
  });
});

describe("drain (notice shutting_down)", () => {
  test("streams stay on the draining connection; new generates wait for the next one", () => {
    const p = machine();
    const a = started(p, 1, { requestId: "ra", streamId: "A" });
    p.receive(1, { type: "notice", code: "shutting_down", message: "bye", drain_s: 30 });
    assert.deepEqual(actions(p), [
      { type: "drain", conn: 1, drainS: 30 },
      { type: "client", name: "notice", detail: { code: "shutting_down", message: "bye", drainS: 30 } },
    ]);
    assert.equal(p.primary, null);
    assert.equal(p.draining(1), true);
    const b = p.generate({ ...ask, requestId: "rb" });
    assert.deepEqual(sends(p), []); // not on the draining socket
    p.opened(2);
    assert.deepEqual(sends(p).map(([c, f]) => [c, f.type, f.request_id]), [[2, "generate", "rb"]]);
    p.receive(1, token(1, "a1", "A")); // the old socket still delivers A
    assert.equal(a.text, "a1");
    p.closed(1); // the gateway closes it (1001): A resumes on the new socket
    assert.deepEqual(sends(p), [[2, { type: "resume", stream_id: "A", resume_token: "tok-A", after: 1 }]]);
    assert.equal(b.conn, 2);
  });

  test("unavailable from the draining gateway: straight to the next connection, not a retry", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate({ ...ask, requestId: "r1" });
    p.takeActions();
    p.receive(1, { type: "notice", code: "shutting_down", message: "", drain_s: 5 });
    p.receive(1, { type: "error", code: "unavailable", message: "shutting down", request_id: "r1" });
    assert.deepEqual(sends(p), []);
    assert.equal(s.waiting, false);
    p.opened(2);
    assert.deepEqual(sends(p).map(([c, f]) => [c, f.type, f.request_id]), [[2, "generate", "r1"]]);
    assert.equal(p.stats.retries, 0);
    assert.equal(s.state, "pending");
  });

  test("with the next connection already open, the refused generate goes there at once", () => {
    const p = machine();
    p.opened(1);
    const s = p.generate({ ...ask, requestId: "r1" });
    p.receive(1, { type: "notice", code: "shutting_down", message: "", drain_s: 5 });
    p.opened(2);
    p.takeActions();
    p.receive(1, { type: "error", code: "unavailable", message: "shutting down", request_id: "r1" });
    assert.deepEqual(sends(p).map(([c, f]) => [c, f.type]), [[2, "generate"]]);
    assert.equal(s.conn, 2);
  });

  test("a second notice on the same connection is only a notice", () => {
    const p = machine();
    p.opened(1);
    p.receive(1, { type: "notice", code: "shutting_down", drain_s: 5 });
    p.takeActions();
    p.receive(1, { type: "notice", code: "shutting_down", drain_s: 5 });
    assert.deepEqual(actions(p).map((a) => a.type), ["client"]);
  });
});

describe("hello and readiness", () => {
  test("hello is kept, announced, and says whether a worker is ready", () => {
    const p = machine();
    p.opened(1);
    const hello = { type: "hello", protocol: 1, heartbeat_s: 20, worker_ready: false };
    p.receive(1, hello);
    assert.deepEqual(actions(p), [
      { type: "client", name: "readiness", detail: { ready: false } },
      { type: "client", name: "open", detail: { hello } },
    ]);
    assert.equal(p.hello, hello);
    assert.equal(p.workerReady, false);
  });
});

describe("exactly-once under random delivery", () => {
  function mulberry32(seed) {
    return () => {
      seed |= 0;
      seed = (seed + 0x6d2b79f5) | 0;
      let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
      t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  test("repeats, losses, reconnects and refusals: every seq once, in order", () => {
    for (let seed = 1; seed <= 300; seed++) {
      const rnd = mulberry32(seed);
      const n = 3 + Math.floor(rnd() * 30);
      const log = Array.from({ length: n }, (_, i) => token(i + 1, `t${i + 1} `));
      log.push(done(n + 1));
      const p = machine({ random: rnd, retryLimit: 1000 });
      let conn = 1;
      p.opened(conn);
      const s = p.generate({ ...ask, requestId: "r" });
      const seqs = [];
      let cursor = 0; // what the fake server sends next on this connection
      let attached = false;
      let guard = 0;
      while (!s.closed && guard++ < 5000) {
        for (const a of p.takeActions()) {
          if (a.type === "send" && a.conn === conn) {
            if (a.frame.type === "generate") {
              if (rnd() < 0.2) p.receive(conn, { type: "error", code: "overloaded", message: "", request_id: "r", retry_after: 0 });
              else {
                p.receive(conn, { type: "started", request_id: "r", stream_id: "S1", resume_token: "T" });
                attached = true;
                cursor = 0;
              }
            } else if (a.frame.type === "resume") {
              p.receive(conn, { type: "resumed", stream_id: "S1", after: a.frame.after });
              attached = true;
              cursor = Math.max(0, a.frame.after - Math.floor(rnd() * 4)); // replay overlap
            }
          } else if (a.type === "timer") {
            p.timer(a.key); // time passes
          } else if (a.type === "stream" && a.name === "token") {
            seqs.push(a.detail.seq);
          }
        }
        const r = rnd();
        if (attached && cursor < log.length && r < 0.7) {
          p.receive(conn, log[cursor]);
          cursor += rnd() < 0.1 ? 2 : 1; // sometimes an event is lost on the wire
          if (rnd() < 0.1) cursor = Math.max(0, cursor - 2); // sometimes repeated
        } else if (r < 0.8) {
          p.closed(conn);
          attached = false;
          conn += 1;
          p.opened(conn);
        }
      }
      assert.equal(s.state, "done", `seed ${seed}`);
      assert.equal(s.text, log.slice(0, n).map((f) => f.text).join(""), `seed ${seed}`);
      assert.deepEqual(seqs, log.slice(0, n).map((f) => f.seq), `seed ${seed}`);
    }
  });
});
