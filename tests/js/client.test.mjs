// Unit tests of static/tokenrelay-client.js with Node's built-in runner: `node --test tests/js/`.
import assert from "node:assert/strict";
import { beforeEach, describe, test } from "node:test";

import {
  backoffDelay,
  DEFAULTS,
  resolveEndpoint,
  wsTokenFetcher,
} from "../../static/tokenrelay-client.js";
import {
  FakeClock,
  FakeServer,
  FakeWebSocket,
  ask,
  clientFactory,
  fakeWindow,
  record,
  toolAnswer,
} from "./helpers.mjs";

let clock;
let server;
let win;

const { makeClient, connected } = clientFactory(() => ({ clock, server, win }));

beforeEach(() => {
  FakeWebSocket.reset();
  clock = new FakeClock();
  server = new FakeServer();
  win = fakeWindow();
});

describe("helpers", () => {
  test("backoff grows exponentially up to the cap", () => {
    const o = { backoffInitial: 100, backoffMax: 1000, backoffFactor: 2, backoffJitter: 0 };
    assert.deepEqual(
      [0, 1, 2, 3, 4, 5, 20].map((a) => backoffDelay(a, o)),
      [100, 200, 400, 800, 1000, 1000, 1000],
    );
  });

  test("jitter draws from [d*(1-jitter), d]", () => {
    const o = { backoffInitial: 1000, backoffMax: 60000, backoffJitter: 0.5 };
    assert.equal(backoffDelay(0, o, () => 0), 1000);
    assert.equal(backoffDelay(0, o, () => 0.999999), 500);
    assert.equal(backoffDelay(2, o, () => 0.5), 3000);
    for (let i = 0; i < 200; i++) {
      const d = backoffDelay(3, o);
      assert.ok(d >= 4000 && d <= 8000, `delay ${d}`);
    }
  });

  test("default backoff starts fast and stays bounded", () => {
    assert.ok(backoffDelay(0, {}, () => 0) <= 500);
    assert.equal(backoffDelay(50, {}, () => 0), DEFAULTS.backoffMax);
  });

  test("endpoints resolve to the /v1/ws URL", () => {
    assert.equal(resolveEndpoint("http://h:8000", "http://x/"), "ws://h:8000/v1/ws");
    assert.equal(resolveEndpoint("https://h/base/", "http://x/"), "wss://h/base/v1/ws");
    assert.equal(resolveEndpoint("wss://h/v1/ws", "http://x/"), "wss://h/v1/ws");
    assert.equal(resolveEndpoint("", "https://page.test/chat?x=1"), "wss://page.test/v1/ws");
    assert.equal(resolveEndpoint("/", "http://127.0.0.1:8000/"), "ws://127.0.0.1:8000/v1/ws");
    assert.throws(() => resolveEndpoint("ftp://h/", "http://x/"), TypeError);
  });
});

describe("streaming", () => {
  test("generate sends one generate frame and delivers token, done, finished", async () => {
    const client = makeClient();
    const stream = client.generate({ ...ask, requestId: "r1" });
    assert.equal(client.state, "connecting");
    const ws = FakeWebSocket.last();
    assert.equal(ws.url, "ws://gateway.test:8000/v1/ws");
    server.connect(ws);
    assert.equal(client.state, "open");
    assert.deepEqual(ws.sentOfType("generate"), [
      { type: "generate", request_id: "r1", messages: ask.messages, params: ask.params },
    ]);
    const log = record(stream, "started", "token", "done");
    server.finish(server.onlyStreamId());
    assert.deepEqual(
      log.map((e) => e.type),
      ["token", "token", "token", "token", "token", "token", "done"],
    );
    assert.equal(stream.text, server.fullText());
    assert.equal(stream.state, "done");
    const result = await stream.finished;
    assert.deepEqual(result, {
      text: "Hello, world!",
      finishReason: "stop",
      usage: { prompt_tokens: 5, completion_tokens: 6 },
      error: null,
    });
    assert.equal(stream.lastSeq, 7);
    assert.equal(client.streams.length, 0);
  });

  test("a notice frame becomes a notice event and changes nothing else", () => {
    const client = connected();
    const stream = client.generate(ask);
    const notices = [];
    client.addEventListener("notice", (e) => notices.push(e.detail));
    const ws = FakeWebSocket.last();
    ws.push({ type: "notice", code: "shutting_down", message: "draining", drain_s: 30 });
    assert.deepEqual(notices, [{ code: "shutting_down", message: "draining", drainS: 30 }]);
    assert.equal(client.state, "open");
    server.finish(server.onlyStreamId());
    assert.equal(stream.state, "done");
  });

  test("started carries the stream id and resume token", () => {
    const client = connected();
    const stream = client.generate(ask);
    assert.equal(stream.streamId, server.onlyStreamId());
    assert.equal(stream.resumeToken, `tok-${stream.streamId}`);
    assert.equal(stream.promptTokens, 5);
    assert.deepEqual(stream.toJSON(), {
      streamId: stream.streamId,
      resumeToken: stream.resumeToken,
      after: 0,
      text: "",
    });
  });

  test("a prompt instead of messages", () => {
    const client = connected();
    client.generate({ prompt: "Once upon" });
    assert.equal(FakeWebSocket.last().sentOfType("generate")[0].prompt, "Once upon");
    assert.throws(() => client.generate({}), TypeError);
  });

  test("model and a tool round trip reach the generate frames", () => {
    const client = connected();
    const tools = [{ type: "function", function: { name: "clock", parameters: { type: "object" } } }];
    const question = { role: "user", content: "What time is it?" };
    const first = client.generate({ messages: [question], params: { tools }, model: "tiny-chat" });
    const ws = FakeWebSocket.last();
    assert.deepEqual(ws.sentOfType("generate").map((f) => [f.model, f.messages, f.params]), [
      ["tiny-chat", [question], { tools }],
    ]);
    const calls = [{ id: "call_7", type: "function", function: { name: "clock", arguments: "{}" } }];
    const log = record(first, "done");
    ws.push({
      type: "done",
      stream_id: first.streamId,
      seq: 1,
      finish_reason: "tool_calls",
      usage: { prompt_tokens: 5, completion_tokens: 3 },
      tool_calls: calls,
    });
    assert.deepEqual(log[0].toolCalls, calls);
    const messages = [
      question,
      { role: "assistant", content: null, tool_calls: log[0].toolCalls },
      { role: "tool", tool_call_id: "call_7", content: "12:00" },
    ];
    client.generate({ messages, params: { tools }, model: "tiny-chat", requestId: "r2" });
    assert.deepEqual(ws.sentOfType("generate")[1], {
      type: "generate",
      request_id: "r2",
      messages,
      params: { tools },
      model: "tiny-chat",
    });
  });

  test("several streams share one socket", () => {
    const client = connected();
    const a = client.generate(ask);
    const b = client.generate(ask);
    assert.equal(FakeWebSocket.instances.length, 1);
    server.emit(a.streamId, 2);
    server.emit(b.streamId, 1);
    server.finish(b.streamId);
    server.finish(a.streamId);
    assert.equal(a.text, server.fullText());
    assert.equal(b.text, server.fullText());
  });
});

describe("dedupe by seq", () => {
  test("duplicated events are dropped", () => {
    const client = connected();
    const stream = client.generate(ask);
    const ws = FakeWebSocket.last();
    server.emit(stream.streamId, 2);
    const ev = server.streams.get(stream.streamId).events;
    ws.push(ev[0]);
    ws.push(ev[1]);
    server.finish(stream.streamId);
    ws.push(ev[2]);
    assert.equal(stream.text, "Hello, world!");
    assert.equal(client.stats.duplicates, 2);
  });

  test("a gap asks for a replay from the last seq and never skips text", () => {
    const client = connected();
    const stream = client.generate(ask);
    const ws = FakeWebSocket.last();
    const id = stream.streamId;
    server.emit(id, 1);
    server.streams.get(id).sockets.delete(ws); // lose the next events on the wire
    server.emit(id, 2);
    server.streams.get(id).sockets.add(ws);
    const seen = [];
    stream.addEventListener("token", (e) => seen.push(e.detail.seq));
    server.emit(id, 1); // seq 4 arrives after a gap: dropped, and a replay is asked for
    assert.equal(client.stats.gaps, 1);
    assert.deepEqual(ws.sentOfType("resume"), [
      { type: "resume", stream_id: id, resume_token: `tok-${id}`, after: 1 },
    ]);
    assert.deepEqual(seen, [2, 3, 4]); // the replay filled the gap, in order
    assert.equal(stream.text, "Hello, wor");
    server.finish(id);
    assert.equal(stream.text, server.fullText());
  });

  test("a done ahead of missing tokens triggers a replay, not an early end", () => {
    const client = connected();
    const stream = client.generate(ask);
    const ws = FakeWebSocket.last();
    const id = stream.streamId;
    server.streams.get(id).sockets.delete(ws);
    server.finish(id);
    const log = record(stream, "token", "done");
    ws.push(server.streams.get(id).events.at(-1)); // only the done arrives
    assert.equal(ws.sentOfType("resume").length, 1); // replayed synchronously by the fake
    assert.deepEqual(
      log.map((e) => e.type),
      ["token", "token", "token", "token", "token", "token", "done"],
    );
    assert.equal(stream.text, server.fullText());
    assert.equal(stream.state, "done");
  });
});

describe("reconnect and resume", () => {
  test("a dropped socket reconnects with backoff and resumes from the last seq", () => {
    server.replayOverlap = 3; // the server replays some events we already have
    const client = connected();
    const states = record(client, "state");
    const stream = client.generate(ask);
    const id = stream.streamId;
    server.emit(id, 3);
    FakeWebSocket.last().drop();
    assert.equal(client.state, "reconnecting");
    assert.equal(states.at(-1).delay, backoffDelay(0, DEFAULTS, () => 0.5));
    server.emit(id, 1); // generated while we were away
    clock.tick(states.at(-1).delay);
    const ws2 = FakeWebSocket.last();
    assert.equal(FakeWebSocket.instances.length, 2);
    server.connect(ws2);
    assert.deepEqual(ws2.sent, [
      { type: "resume", stream_id: id, resume_token: `tok-${id}`, after: 3 },
    ]);
    assert.equal(stream.resumes, 1);
    assert.equal(client.stats.resumes, 1);
    assert.equal(client.stats.reconnects, 1);
    server.finish(id);
    assert.equal(stream.text, server.fullText());
    assert.equal(client.stats.duplicates, 3);
    assert.deepEqual(
      states.map((s) => s.state),
      ["reconnecting", "open"],
    );
  });

  test("repeated failures back off exponentially; a hello resets the backoff", () => {
    const client = connected({ backoffJitter: 0 });
    const states = record(client, "state");
    FakeWebSocket.last().drop();
    for (let i = 0; i < 4; i++) {
      const delay = states.at(-1).delay;
      assert.equal(delay, 250 * 2 ** i);
      clock.tick(delay - 1);
      const count = FakeWebSocket.instances.length;
      clock.tick(1);
      assert.equal(FakeWebSocket.instances.length, count + 1);
      FakeWebSocket.last().drop(); // connection refused
    }
    clock.tick(states.at(-1).delay);
    server.connect(FakeWebSocket.last());
    assert.equal(client.state, "open");
    FakeWebSocket.last().drop();
    assert.equal(states.at(-1).delay, 250);
  });

  test("a generate whose started never came is sent again after reconnect", () => {
    const client = makeClient();
    const stream = client.generate({ ...ask, requestId: "r9" });
    const ws1 = FakeWebSocket.last();
    ws1.accept(); // no server: the generate is lost
    assert.equal(ws1.sentOfType("generate").length, 1);
    ws1.drop();
    clock.tick(10_000);
    server.connect(FakeWebSocket.last());
    assert.equal(FakeWebSocket.last().sentOfType("generate")[0].request_id, "r9");
    server.finish(stream.streamId);
    assert.equal(stream.text, server.fullText());
  });

  test("resume() re-attaches a saved stream (page reload)", async () => {
    const first = connected();
    const s1 = first.generate(ask);
    server.emit(s1.streamId, 2);
    const saved = s1.toJSON();
    first.close();
    assert.equal(first.state, "closed");
    server.emit(saved.streamId, 2);

    const second = makeClient();
    const s2 = second.resume(saved);
    assert.equal(s2.text, "Hello");
    server.connect(FakeWebSocket.last());
    assert.deepEqual(FakeWebSocket.last().sent[0], {
      type: "resume",
      stream_id: saved.streamId,
      resume_token: saved.resumeToken,
      after: 2,
    });
    server.finish(saved.streamId);
    assert.equal((await s2.finished).text, server.fullText());
  });

  test("streamed tool calls: a tool-call event per delta, toolCalls so far, saved and resumed", async () => {
    server = new FakeServer(toolAnswer());
    const first = connected();
    const s1 = first.generate(ask);
    const log = record(s1, "tool-call");
    server.emit(s1.streamId, 3);
    const soFar = { id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"city": ' } };
    assert.deepEqual(s1.toolCalls, [soFar]);
    assert.deepEqual(log.map((e) => [e.seq, e.id, e.name, e.first, e.argumentsDelta, e.arguments]), [
      [2, "call_1", "get_weather", true, "", ""],
      [3, "call_1", "get_weather", false, '{"city": ', '{"city": '],
    ]);
    const saved = s1.toJSON();
    assert.deepEqual(saved.toolCalls, [soFar]);
    first.close();
    server.emit(saved.streamId, 2);

    // a reload: a new client resumes with what was saved, and the call goes on from there
    const second = makeClient();
    const s2 = second.resume(saved);
    const later = record(s2, "tool-call");
    server.connect(FakeWebSocket.last());
    assert.deepEqual(later.map((e) => [e.seq, e.first, e.arguments]), [[5, false, '{"city": "Paris"}']]);
    server.finish(saved.streamId);
    const result = await s2.finished;
    assert.equal(result.text, "Let me check.");
    assert.deepEqual(s2.toolCalls, toolAnswer().end.tool_calls); // the done frame's list
  });

  test("resuming an unknown stream ends it with not_found", async () => {
    const client = connected();
    const stream = client.resume({ streamId: "nope-nope-nope-nope", resumeToken: "x", after: 3 });
    const result = await stream.finished;
    assert.equal(result.error.code, "not_found");
    assert.equal(stream.state, "error");
  });

  test("a policy close (1008) does not reconnect and fails the streams", async () => {
    const client = connected();
    const stream = client.generate(ask);
    FakeWebSocket.last().drop(1008, "unauthorized");
    assert.equal(client.state, "closed");
    assert.equal((await stream.finished).error.code, "forbidden");
    clock.tick(60_000);
    assert.equal(FakeWebSocket.instances.length, 1);
  });

  test("maxRetries gives up with unavailable", async () => {
    const client = connected({ maxRetries: 2 });
    const stream = client.generate(ask);
    FakeWebSocket.last().drop();
    clock.tick(60_000);
    FakeWebSocket.last().drop();
    clock.tick(60_000);
    FakeWebSocket.last().drop();
    assert.equal(client.state, "closed");
    assert.equal((await stream.finished).error.code, "unavailable");
  });

  test("a socket that never opens is abandoned after connectTimeout", () => {
    const client = makeClient({ connectTimeout: 1000 });
    client.connect();
    clock.tick(999);
    assert.equal(FakeWebSocket.instances.length, 1);
    clock.tick(1);
    assert.equal(client.state, "reconnecting");
    clock.tick(backoffDelay(0, DEFAULTS, () => 0.5));
    assert.equal(FakeWebSocket.instances.length, 2);
  });

  test("dropConnection() reconnects and resumes (QA button)", () => {
    const client = connected();
    const stream = client.generate(ask);
    server.emit(stream.streamId, 2);
    const ws1 = FakeWebSocket.last();
    client.dropConnection();
    assert.equal(ws1.closedWith.code, 4000);
    assert.equal(client.state, "reconnecting");
    assert.equal(client.stats.drops, 1);
    server.emit(stream.streamId, 2);
    clock.tick(1000);
    server.connect(FakeWebSocket.last());
    server.finish(stream.streamId);
    assert.equal(stream.text, server.fullText());
  });
});

describe("heartbeat", () => {
  test("a silent socket is declared dead within interval + timeout", () => {
    const client = connected({ heartbeatInterval: 2000, heartbeatTimeout: 1500 });
    const ws = FakeWebSocket.last();
    ws.server = null; // the network is dead: pings get no pong
    const log = record(client, "heartbeat-timeout");
    clock.tick(2000);
    assert.deepEqual(ws.sentOfType("ping"), [{ type: "ping" }]);
    clock.tick(1499);
    assert.equal(client.state, "open");
    clock.tick(1);
    assert.equal(log.length, 1);
    assert.equal(client.state, "reconnecting");
    assert.equal(ws.closedWith.code, 4003);
  });

  test("pongs keep the socket alive", () => {
    const client = connected({ heartbeatInterval: 2000, heartbeatTimeout: 1500 });
    clock.tick(20_000);
    assert.equal(client.state, "open");
    assert.equal(FakeWebSocket.last().sentOfType("ping").length, 10);
    assert.equal(FakeWebSocket.instances.length, 1);
  });

  test("token frames count as signs of life", () => {
    const client = connected({ heartbeatInterval: 2000, heartbeatTimeout: 1500 });
    const stream = client.generate(ask);
    server.receive = (sock, f) => {
      if (f.type !== "ping") FakeServer.prototype.receive.call(server, sock, f);
    };
    for (let i = 0; i < 5; i++) {
      clock.tick(1000);
      server.emit(stream.streamId, 1);
    }
    assert.equal(client.state, "open");
  });
});

describe("online and offline", () => {
  test("offline closes the socket and waits; online reconnects at once", () => {
    const client = connected();
    const stream = client.generate(ask);
    server.emit(stream.streamId, 2);
    const ws1 = FakeWebSocket.last();
    win.dispatchEvent(new Event("offline"));
    assert.equal(client.state, "offline");
    assert.equal(ws1.readyState, 3);
    clock.tick(DEFAULTS.backoffMax - 1);
    assert.equal(FakeWebSocket.instances.length, 1, "no retry storm while offline");
    server.emit(stream.streamId, 2);
    win.dispatchEvent(new Event("online"));
    assert.equal(FakeWebSocket.instances.length, 2);
    server.connect(FakeWebSocket.last());
    assert.equal(client.state, "open");
    server.finish(stream.streamId);
    assert.equal(stream.text, server.fullText());
  });

  test("navigator.onLine false means state offline and slow retries", () => {
    const nav = { onLine: true };
    const client = connected({ navigator: nav });
    nav.onLine = false;
    FakeWebSocket.last().drop();
    assert.equal(client.state, "offline");
    assert.deepEqual(clock.pending().filter((d) => d > 5000), [DEFAULTS.backoffMax]);
  });

  test("close() stops listening and reconnecting", () => {
    const client = connected();
    client.close();
    win.dispatchEvent(new Event("online"));
    clock.tick(60_000);
    assert.equal(FakeWebSocket.instances.length, 1);
    assert.equal(client.state, "closed");
  });
});

describe("cancel", () => {
  test("cancel sends the frame and ends with the server's cancelled done", async () => {
    const client = connected();
    const stream = client.generate(ask);
    server.emit(stream.streamId, 2);
    stream.cancel();
    assert.deepEqual(FakeWebSocket.last().sentOfType("cancel"), [
      { type: "cancel", stream_id: stream.streamId, resume_token: stream.resumeToken },
    ]);
    server.emit(stream.streamId, 1);
    const result = await stream.finished;
    assert.equal(result.finishReason, "cancelled");
    assert.equal(result.text, "Hello");
  });

  test("cancel before started is sent once the stream id is known", () => {
    const client = makeClient();
    const stream = client.generate(ask);
    const ws = FakeWebSocket.last();
    ws.accept(); // no server: the generate goes out, started has not come back yet
    stream.cancel();
    assert.equal(ws.sentOfType("cancel").length, 0);
    ws.push({
      type: "started",
      request_id: stream.requestId,
      stream_id: "s2-0123456789abcdef",
      resume_token: "t",
    });
    assert.deepEqual(ws.sentOfType("cancel"), [
      { type: "cancel", stream_id: "s2-0123456789abcdef", resume_token: "t" },
    ]);
  });

  test("cancel before anything was sent ends locally", async () => {
    const client = makeClient();
    const stream = client.generate(ask);
    stream.cancel();
    assert.equal((await stream.finished).finishReason, "cancelled");
    server.connect(FakeWebSocket.last());
    assert.equal(FakeWebSocket.last().sentOfType("generate").length, 0);
  });

  test("cancel while disconnected goes out after the resume", () => {
    const client = connected();
    const stream = client.generate(ask);
    server.emit(stream.streamId, 1);
    FakeWebSocket.last().drop();
    stream.cancel();
    clock.tick(1000);
    server.connect(FakeWebSocket.last());
    assert.deepEqual(
      FakeWebSocket.last().sent.map((f) => f.type),
      ["resume", "cancel"],
    );
    server.emit(stream.streamId, 1);
    assert.equal(stream.finishReason, "cancelled");
  });

  test("no answer to cancel: the stream ends locally after cancelTimeout", async () => {
    const client = connected({ cancelTimeout: 3000 });
    const stream = client.generate(ask);
    FakeWebSocket.last().server = null;
    stream.cancel();
    clock.tick(2999);
    assert.equal(stream.state, "streaming");
    clock.tick(1);
    assert.equal((await stream.finished).finishReason, "cancelled");
  });
});

describe("errors", () => {
  test("an error frame for our request fails that stream only", async () => {
    const client = connected();
    const a = client.generate({ ...ask, requestId: "bad" });
    const b = client.generate(ask);
    FakeWebSocket.last().push({ type: "error", code: "bad_request", message: "nope", request_id: "bad" });
    assert.deepEqual((await a.finished).error, { code: "bad_request", message: "nope" });
    assert.equal(b.state, "streaming");
  });

  test("other error frames surface on the client", () => {
    const client = connected();
    const log = record(client, "error");
    FakeWebSocket.last().push({ type: "error", code: "bad_request", message: "frame is not valid JSON" });
    assert.equal(log[0].code, "bad_request");
  });

  test("garbage and unknown frames are ignored", () => {
    const client = connected();
    const ws = FakeWebSocket.last();
    ws.onmessage({ data: "{not json" });
    ws.push({ type: "future-thing" });
    assert.equal(client.state, "open");
  });
});

describe("exactly-once text under random chaos", () => {
  // Seeded PRNG so a failure is reproducible.
  function mulberry32(seed) {
    return () => {
      seed |= 0;
      seed = (seed + 0x6d2b79f5) | 0;
      let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
      t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  test("drops, offline blips, heartbeat deaths and overlapping replays", () => {
    for (let seed = 1; seed <= 200; seed++) {
      const rnd = mulberry32(seed);
      FakeWebSocket.reset();
      clock = new FakeClock();
      win = fakeWindow();
      const chunks = Array.from({ length: 5 + Math.floor(rnd() * 40) }, (_, i) => `t${i}·`);
      server = new FakeServer({ chunks, replayOverlap: Math.floor(rnd() * 5) });
      const client = connected({ random: rnd });
      const stream = client.generate(ask);
      const tokens = [];
      stream.addEventListener("token", (e) => tokens.push(e.detail.seq));
      const id = stream.streamId;
      let guard = 0;
      while (!stream.closed && guard++ < 1000) {
        const r = rnd();
        const ws = FakeWebSocket.last();
        if (r < 0.5) server.emit(id, 1 + Math.floor(rnd() * 3));
        else if (r < 0.6 && ws.readyState === 1) ws.drop();
        else if (r < 0.65) win.dispatchEvent(new Event("offline"));
        else if (r < 0.7) win.dispatchEvent(new Event("online"));
        else if (r < 0.75 && ws.readyState === 1) ws.server = null; // goes silent
        else clock.tick(Math.floor(rnd() * 3000));
        const now = FakeWebSocket.last();
        if (now.readyState === 0 && rnd() < 0.7) server.connect(now);
      }
      assert.equal(stream.state, "done", `seed ${seed}`);
      assert.equal(stream.text, server.fullText(), `seed ${seed}`);
      assert.deepEqual(
        tokens,
        chunks.map((_, i) => i + 1),
        `seed ${seed}: every seq exactly once, in order`,
      );
    }
  });
});

describe("transient store errors", () => {
  test("an unavailable error on a stream retries the resume instead of failing", () => {
    const client = connected();
    const stream = client.generate(ask);
    server.emit(stream.streamId, 2);
    const ws = FakeWebSocket.last();
    ws.push({ type: "error", code: "unavailable", message: "resume later", stream_id: stream.streamId });
    assert.equal(stream.state, "streaming");
    clock.tick(10_000);
    assert.deepEqual(ws.sentOfType("resume").at(-1).after, 2);
    server.finish(stream.streamId);
    assert.equal(stream.text, server.fullText());
  });

  test("unavailable for a generate (no worker) fails it once no retry is left", async () => {
    const client = connected({ retryLimit: 0 }); // retries: client-async.test.mjs
    const ws = FakeWebSocket.last();
    ws.server = null;
    const stream = client.generate({ ...ask, requestId: "r" });
    ws.push({ type: "error", code: "unavailable", message: "no engine worker", request_id: "r" });
    assert.equal((await stream.finished).error.code, "unavailable");
  });
});

describe("auth tokens", () => {
  const flush = () => new Promise((resolve) => setTimeout(resolve, 0));

  test("a token string goes on the URL as ?token=", () => {
    makeClient({ token: "v1.abc.9.n.sig" }).connect();
    const url = new URL(FakeWebSocket.last().url);
    assert.equal(url.pathname, "/v1/ws");
    assert.equal(url.searchParams.get("token"), "v1.abc.9.n.sig");
  });

  test("a token function is called before every connect", async () => {
    let calls = 0;
    const client = makeClient({ token: async () => `t${++calls}` });
    client.connect();
    assert.equal(FakeWebSocket.instances.length, 0); // waiting for the token
    await flush();
    assert.equal(new URL(FakeWebSocket.last().url).searchParams.get("token"), "t1");
    server.connect(FakeWebSocket.last());
    FakeWebSocket.last().drop(1006, "network");
    clock.tick(10_000);
    await flush();
    assert.equal(calls, 2);
    assert.equal(new URL(FakeWebSocket.last().url).searchParams.get("token"), "t2");
  });

  test("a null token (gateway without keys) connects without one", async () => {
    makeClient({ token: async () => null }).connect();
    await flush();
    assert.equal(new URL(FakeWebSocket.last().url).search, "");
  });

  test("an unauthorized token fetch ends the client; other failures retry", async () => {
    const denied = Object.assign(new Error("no key"), { code: "unauthorized" });
    const client = makeClient({ token: async () => Promise.reject(denied) });
    const stream = client.generate(ask);
    await flush();
    assert.equal(client.state, "closed");
    assert.equal((await stream.finished).error.code, "unauthorized");
    let n = 0;
    const flaky = makeClient({
      token: async () => {
        n += 1;
        if (n === 1) throw new Error("network");
        return "ok";
      },
    });
    flaky.connect();
    await flush();
    assert.equal(flaky.state, "reconnecting");
    clock.tick(10_000);
    await flush();
    assert.equal(new URL(FakeWebSocket.last().url).searchParams.get("token"), "ok");
  });

  test("wsTokenFetcher trades the key at POST /v1/ws-token", async () => {
    const seen = [];
    const fetch = async (url, init) => {
      seen.push({ url, init });
      if (init.headers.Authorization !== "Bearer sk-1") return { ok: false, status: 401 };
      return { ok: true, status: 200, json: async () => ({ token: "tok" }) };
    };
    const get = wsTokenFetcher(() => "sk-1", { endpoint: "https://gw.test/base/v1/ws", fetch });
    assert.equal(await get(), "tok");
    assert.equal(seen[0].url, "https://gw.test/base/v1/ws-token");
    assert.equal(seen[0].init.method, "POST");
    const bad = wsTokenFetcher("sk-2", { endpoint: "http://gw.test/", fetch });
    await assert.rejects(bad(), (err) => err.code === "unauthorized");
  });
});
