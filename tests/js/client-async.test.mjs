// static/tokenrelay-client.js: for-await, AbortSignal, retries of refused requests and
// gateway drains, over the fake socket and server of helpers.mjs. `node --test tests/js/`.
import assert from "node:assert/strict";
import { beforeEach, describe, test } from "node:test";

import {
  DEFAULTS,
  RETRYABLE_CODES,
  TokenRelayError,
  TokenRelayStream,
} from "../../static/tokenrelay-client.js";
import { retryDelay } from "../../static/tokenrelay-protocol.js";
import { FakeClock, FakeServer, FakeWebSocket, ask, clientFactory, fakeWindow } from "./helpers.mjs";

let clock;
let server;
let win;

const { makeClient, connected } = clientFactory(() => ({ clock, server, win }));
const flush = () => new Promise((resolve) => setImmediate(resolve));

/** Make the fake server refuse the next `n` generates with `code` (and `retry_after`). */
function refuseGenerates(n, code, retryAfter) {
  const receive = server.receive.bind(server);
  let left = n;
  server.receive = (ws, f) => {
    if (f.type === "generate" && left > 0) {
      left -= 1;
      server.received.push(f);
      const frame = { type: "error", code, message: `refused (${code})`, request_id: f.request_id };
      if (retryAfter !== undefined) frame.retry_after = retryAfter;
      ws.push(frame);
      return;
    }
    receive(ws, f);
  };
}

beforeEach(() => {
  FakeWebSocket.reset();
  clock = new FakeClock();
  server = new FakeServer();
  win = fakeWindow();
});

describe("for await", () => {
  test("yields the text of every token in order and ends after done", async () => {
    const client = connected();
    const stream = client.generate(ask);
    assert.ok(stream instanceof TokenRelayStream);
    server.emit(stream.streamId, 2); // before the loop starts: still yielded
    const seen = [];
    const loop = (async () => {
      for await (const text of stream) seen.push(text);
    })();
    await flush();
    server.emit(stream.streamId, 1);
    await flush();
    server.finish(stream.streamId);
    await loop;
    assert.deepEqual(seen, server.chunks);
    assert.equal(seen.join(""), stream.text);
  });

  test("two loops over one stream each get every chunk", async () => {
    const client = connected();
    const stream = client.generate(ask);
    server.finish(stream.streamId);
    const a = [];
    const b = [];
    for await (const t of stream) a.push(t);
    for await (const t of stream) b.push(t);
    assert.deepEqual(a, server.chunks);
    assert.deepEqual(b, server.chunks);
  });

  test("a resumed stream yields the text it was resumed with first", async () => {
    const first = connected();
    const s1 = first.generate(ask);
    server.emit(s1.streamId, 2);
    const saved = s1.toJSON();
    first.close();
    const second = connected();
    const s2 = second.resume(saved);
    server.finish(saved.streamId);
    const seen = [];
    for await (const t of s2) seen.push(t);
    assert.deepEqual(seen, ["Hello", ...server.chunks.slice(2)]);
  });

  test("a failed stream throws a TokenRelayError with the code", async () => {
    const client = connected();
    const stream = client.resume({ streamId: "nope-nope-nope-nope", resumeToken: "x" });
    await assert.rejects(
      (async () => {
        for await (const _ of stream) assert.fail("no text expected");
      })(),
      (err) =>
        err instanceof TokenRelayError &&
        err.name === "TokenRelayError" &&
        err.code === "not_found" &&
        err.streamId === "nope-nope-nope-nope" &&
        err.retryAfter === null,
    );
    assert.equal((await stream.finished).error.code, "not_found"); // finished never rejects
  });

  test("break cancels the stream", async () => {
    const client = connected();
    const stream = client.generate(ask);
    server.emit(stream.streamId, 3);
    for await (const text of stream) {
      assert.equal(text, "Hel");
      break;
    }
    assert.equal(FakeWebSocket.last().sentOfType("cancel").length, 1);
    server.emit(stream.streamId, 1);
    assert.equal((await stream.finished).finishReason, "cancelled");
  });
});

describe("AbortSignal", () => {
  test("abort mid-stream sends cancel and the loop throws an AbortError", async () => {
    const client = connected();
    const controller = new AbortController();
    const stream = client.generate({ ...ask, signal: controller.signal });
    server.emit(stream.streamId, 2);
    const seen = [];
    const loop = (async () => {
      for await (const text of stream) {
        seen.push(text);
        if (seen.length === 2) controller.abort();
      }
    })();
    await assert.rejects(loop, (err) => err.name === "AbortError");
    assert.deepEqual(seen, ["Hel", "lo"]);
    assert.deepEqual(FakeWebSocket.last().sentOfType("cancel"), [
      { type: "cancel", stream_id: stream.streamId, resume_token: stream.resumeToken },
    ]);
    server.emit(stream.streamId, 1);
    const result = await stream.finished;
    assert.equal(result.finishReason, "cancelled");
    assert.equal(result.text, "Hello");
  });

  test("the loop throws the signal's own reason", async () => {
    const client = connected();
    const controller = new AbortController();
    const stream = client.generate({ ...ask, signal: controller.signal });
    const reason = new Error("user left");
    controller.abort(reason);
    await assert.rejects(
      (async () => {
        for await (const _ of stream);
      })(),
      (err) => err === reason,
    );
  });

  test("an already aborted signal never sends anything", async () => {
    const client = makeClient();
    const stream = client.generate({ ...ask, signal: AbortSignal.abort() });
    assert.equal(stream.closed, true);
    assert.equal(FakeWebSocket.instances.length, 0, "not even a connection");
    client.connect();
    server.connect(FakeWebSocket.last());
    assert.deepEqual(FakeWebSocket.last().sent, []);
    await assert.rejects(
      (async () => {
        for await (const _ of stream);
      })(),
      (err) => err.name === "AbortError",
    );
    const result = await stream.finished;
    assert.equal(result.finishReason, "cancelled");
  });

  test("abort before started: the cancel follows the started", () => {
    const client = makeClient();
    const controller = new AbortController();
    const stream = client.generate({ ...ask, signal: controller.signal });
    const ws = FakeWebSocket.last();
    ws.accept(); // no server: the generate is out, no started yet
    controller.abort();
    assert.equal(ws.sentOfType("cancel").length, 0);
    ws.push({ type: "started", request_id: stream.requestId, stream_id: "S-0123456789abcdef", resume_token: "t" });
    assert.deepEqual(ws.sentOfType("cancel"), [
      { type: "cancel", stream_id: "S-0123456789abcdef", resume_token: "t" },
    ]);
  });

  test("aborting after the end changes nothing", async () => {
    const client = connected();
    const controller = new AbortController();
    const stream = client.generate({ ...ask, signal: controller.signal });
    server.finish(stream.streamId);
    controller.abort();
    assert.equal(FakeWebSocket.last().sentOfType("cancel").length, 0);
    const seen = [];
    for await (const t of stream) seen.push(t);
    assert.equal(seen.join(""), server.fullText());
  });

  test("resume() takes a signal too", async () => {
    const first = connected();
    const saved = first.generate(ask).toJSON();
    first.close();
    const client = connected();
    const controller = new AbortController();
    const stream = client.resume({ ...saved, signal: controller.signal });
    controller.abort();
    assert.deepEqual(FakeWebSocket.last().sentOfType("cancel"), [
      { type: "cancel", stream_id: saved.streamId, resume_token: saved.resumeToken },
    ]);
    assert.equal(stream.cancelRequested, true);
    server.emit(saved.streamId, 1);
    assert.equal((await stream.finished).finishReason, "cancelled");
  });
});

describe("retries", () => {
  for (const code of RETRYABLE_CODES) {
    test(`${code}: the generate goes out again after retry_after plus backoff`, async () => {
      const client = connected();
      refuseGenerates(2, code, 1);
      const stream = client.generate({ ...ask, requestId: "r1" });
      const ws = FakeWebSocket.last();
      assert.equal(ws.sentOfType("generate").length, 1);
      assert.equal(stream.state, "pending");
      const first = retryDelay(1, 1, DEFAULTS, () => 0.5);
      clock.tick(first - 1);
      assert.equal(ws.sentOfType("generate").length, 1, "not before retry_after + backoff");
      clock.tick(1);
      assert.equal(ws.sentOfType("generate").length, 2);
      clock.tick(retryDelay(2, 1, DEFAULTS, () => 0.5));
      assert.equal(ws.sentOfType("generate").length, 3);
      assert.deepEqual(
        ws.sentOfType("generate").map((f) => f.request_id),
        ["r1", "r1", "r1"],
      );
      assert.equal(client.stats.retries, 2);
      server.finish(stream.streamId);
      assert.equal((await stream.finished).text, server.fullText());
    });
  }

  test("past retryLimit the stream fails with the error and its retryAfter", async () => {
    const client = connected({ retryLimit: 2 });
    refuseGenerates(10, "overloaded", 2);
    const stream = client.generate(ask);
    clock.tick(60_000);
    assert.equal(FakeWebSocket.last().sentOfType("generate").length, 3);
    const result = await stream.finished;
    assert.deepEqual(result.error, { code: "overloaded", message: "refused (overloaded)", retryAfter: 2 });
    await assert.rejects(
      (async () => {
        for await (const _ of stream);
      })(),
      (err) => err instanceof TokenRelayError && err.code === "overloaded" && err.retryAfter === 2,
    );
  });

  test("a retry_after beyond retryMaxDelay fails at once", async () => {
    const client = connected({ retryMaxDelay: 5000 });
    refuseGenerates(1, "rate_limited", 60);
    const stream = client.generate(ask);
    assert.equal((await stream.finished).error.retryAfter, 60);
  });

  test("bad_request is not retried", async () => {
    const client = connected();
    refuseGenerates(1, "bad_request");
    const stream = client.generate(ask);
    assert.equal((await stream.finished).error.code, "bad_request");
    assert.equal(client.stats.retries, 0);
  });
});

describe("gateway drain (notice shutting_down)", () => {
  const notice = { type: "notice", code: "shutting_down", message: "draining", drain_s: 30 };

  test("a new socket opens at once; running streams finish on the old one", async () => {
    const client = connected();
    const running = client.generate(ask);
    server.emit(running.streamId, 2);
    const ws1 = FakeWebSocket.last();
    ws1.push(notice);
    assert.equal(FakeWebSocket.instances.length, 2, "the next socket is opening");
    assert.equal(ws1.readyState, 1, "the draining socket stays open");
    assert.equal(client.state, "open");
    const fresh = client.generate(ask); // not sent on the draining socket
    assert.equal(ws1.sentOfType("generate").length, 1);
    server.connect(FakeWebSocket.last());
    const ws2 = FakeWebSocket.last();
    assert.equal(ws2.sentOfType("generate").length, 1);
    assert.equal(ws2.sentOfType("resume").length, 0, "the running stream stays where it is");
    server.finish(running.streamId); // still delivered by the old socket
    server.finish(fresh.streamId);
    assert.equal((await running.finished).text, server.fullText());
    assert.equal((await fresh.finished).text, server.fullText());
    assert.equal(running.resumes, 0);
  });

  test("when the draining gateway closes (1001) its streams resume on the new socket", async () => {
    const client = connected();
    const stream = client.generate(ask);
    server.emit(stream.streamId, 2);
    const ws1 = FakeWebSocket.last();
    ws1.push(notice);
    server.connect(FakeWebSocket.last());
    const ws2 = FakeWebSocket.last();
    ws1.drop(1001, "going away");
    assert.deepEqual(ws2.sentOfType("resume"), [
      { type: "resume", stream_id: stream.streamId, resume_token: stream.resumeToken, after: 2 },
    ]);
    assert.equal(client.state, "open");
    server.finish(stream.streamId);
    assert.equal((await stream.finished).text, server.fullText());
    assert.equal(FakeWebSocket.instances.length, 2);
  });

  test("a generate refused by the draining gateway goes out on the new socket", async () => {
    const client = connected();
    const ws1 = FakeWebSocket.last();
    ws1.server = null; // the draining gateway takes nothing new
    const stream = client.generate({ ...ask, requestId: "r1" });
    ws1.push(notice);
    ws1.push({ type: "error", code: "unavailable", message: "shutting down", request_id: "r1" });
    assert.equal(stream.state, "pending");
    server.connect(FakeWebSocket.last());
    assert.deepEqual(FakeWebSocket.last().sentOfType("generate").map((f) => f.request_id), ["r1"]);
    assert.equal(client.stats.retries, 0);
    server.finish(stream.streamId);
    assert.equal((await stream.finished).text, server.fullText());
  });

  test("a draining socket that outlives drain_s is closed and its streams resumed", () => {
    const client = connected({ heartbeatTimeout: 1000 });
    const stream = client.generate(ask);
    server.emit(stream.streamId, 1);
    const ws1 = FakeWebSocket.last();
    ws1.push({ ...notice, drain_s: 5 });
    server.connect(FakeWebSocket.last());
    const ws2 = FakeWebSocket.last();
    ws1.server = null; // it goes silent and never closes
    clock.tick(5000 + 999);
    assert.equal(ws1.readyState, 1);
    clock.tick(1);
    assert.equal(ws1.closedWith.code, 4004);
    assert.equal(ws2.sentOfType("resume").at(-1).after, 1);
  });

  test("the new socket landing on the draining gateway (closed at once) backs off and retries", async () => {
    const client = connected();
    const stream = client.generate(ask);
    const ws1 = FakeWebSocket.last();
    ws1.push(notice);
    const doomed = FakeWebSocket.last();
    doomed.accept(false); // the draining gateway accepts, then closes with 1001
    doomed.drop(1001, "gateway shutting down");
    assert.equal(client.state, "reconnecting");
    server.emit(stream.streamId, 2); // meanwhile the old socket still delivers
    assert.equal(stream.text, "Hello");
    clock.tick(1000);
    server.connect(FakeWebSocket.last()); // another gateway
    ws1.drop(1001);
    server.finish(stream.streamId);
    assert.equal((await stream.finished).text, server.fullText());
  });

  test("close() closes the draining socket too; dropConnection() as well", () => {
    const client = connected();
    const ws1 = FakeWebSocket.last();
    ws1.push(notice);
    server.connect(FakeWebSocket.last());
    client.dropConnection();
    assert.equal(ws1.closedWith.code, 4000);
    assert.equal(client.state, "reconnecting");
    clock.tick(1000);
    server.connect(FakeWebSocket.last());
    FakeWebSocket.last().push(notice);
    const draining = FakeWebSocket.instances.at(-2);
    const next = FakeWebSocket.last(); // still connecting
    client.close();
    assert.equal(draining.closedWith.code, 1000);
    next.accept(); // closed as soon as it opens
    assert.equal(next.closedWith.code, 1000);
    assert.equal(client.state, "closed");
    clock.tick(60_000);
    assert.equal(FakeWebSocket.instances.length, 4, "no reconnect after close()");
  });
});

describe("TokenRelayError", () => {
  test("carries the code, retryAfter and ids", () => {
    const err = new TokenRelayError(
      { code: "rate_limited", message: "slow down", retryAfter: 3 },
      { streamId: null, requestId: "r1" },
    );
    assert.ok(err instanceof Error);
    assert.equal(err.message, "slow down");
    assert.equal(err.code, "rate_limited");
    assert.equal(err.retryAfter, 3);
    assert.equal(err.requestId, "r1");
  });
});
