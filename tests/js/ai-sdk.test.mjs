// static/tokenrelay-ai-sdk.js (TokenRelayChatTransport, the Vercel AI SDK's ChatTransport)
// over the fake socket and server of helpers.mjs: UI messages to frames, frames to
// UIMessageChunks, abort, the store of streams in flight and reconnectToStream. Needs no `ai`
// package (the transport imports nothing from it); the real AI SDK against a real gateway is
// tests/web/test_ai_sdk_transport.py. `node --test tests/js/`.
import assert from "node:assert/strict";
import { beforeEach, describe, test } from "node:test";

import {
  TokenRelayChatTransport,
  toRelayMessages,
  webStorageStore,
} from "../../static/tokenrelay-ai-sdk.js";
import { TokenRelayError } from "../../static/tokenrelay-client.js";
import { FakeClock, FakeServer, FakeWebSocket, clientFactory, fakeWindow, toolAnswer } from "./helpers.mjs";

let clock;
let server;
let win;

const { makeClient, connected } = clientFactory(() => ({ clock, server, win }));
const flush = () => new Promise((resolve) => setImmediate(resolve));

beforeEach(() => {
  FakeWebSocket.reset();
  clock = new FakeClock();
  server = new FakeServer();
  win = fakeWindow();
});

const user = (text, id = "u1") => ({ id, role: "user", parts: [{ type: "text", text }] });

function send(transport, messages = [user("Hi")], extra = {}) {
  return transport.sendMessages({
    chatId: "c1",
    messages,
    trigger: "submit-message",
    messageId: undefined,
    abortSignal: undefined,
    ...extra,
  });
}

/** Every chunk of a stream that the fake server has already finished. */
async function read(stream) {
  const out = [];
  for await (const chunk of stream) out.push(chunk);
  return out;
}

/** The chunks of toolAnswer() (helpers.mjs) once finished, after `start`. */
const toolChunks = (textId) => [
  { type: "start-step" },
  { type: "text-start", id: textId },
  { type: "text-delta", id: textId, delta: "Let me check." },
  { type: "text-end", id: textId },
  { type: "tool-input-start", toolCallId: "call_1", toolName: "get_weather" },
  { type: "tool-input-delta", toolCallId: "call_1", inputTextDelta: '{"city": ' },
  { type: "tool-input-delta", toolCallId: "call_1", inputTextDelta: '"Paris"}' },
  { type: "tool-input-available", toolCallId: "call_1", toolName: "get_weather", input: { city: "Paris" } },
  { type: "finish-step" },
  { type: "finish", finishReason: "tool-calls" },
];

const texts = (chunks) => chunks.filter((c) => c.type === "text-delta").map((c) => c.delta).join("");

describe("toRelayMessages", () => {
  test("text parts; other parts left out", () => {
    const out = toRelayMessages([
      { id: "s", role: "system", parts: [{ type: "text", text: "Be brief." }] },
      {
        id: "u",
        role: "user",
        parts: [
          { type: "text", text: "Look:" },
          { type: "file", mediaType: "image/png", url: "data:," },
          { type: "text", text: "what is it?" },
        ],
      },
      {
        id: "a",
        role: "assistant",
        parts: [
          { type: "step-start" },
          { type: "reasoning", text: "hmm" },
          { type: "text", text: "A " },
          { type: "text", text: "pixel." },
        ],
      },
    ]);
    assert.deepEqual(out, [
      { role: "system", content: "Be brief." },
      { role: "user", content: "Look:\nwhat is it?" },
      { role: "assistant", content: "A pixel." },
    ]);
  });

  test("tool calls with results become tool_calls and tool messages, one turn a step", () => {
    const out = toRelayMessages([
      user("Weather in Paris and Rome?"),
      {
        id: "a",
        role: "assistant",
        parts: [
          { type: "step-start" },
          { type: "text", text: "Checking." },
          {
            type: "tool-weather",
            toolCallId: "call_1",
            state: "output-available",
            input: { city: "Paris" },
            output: { temp: 21 },
          },
          {
            type: "dynamic-tool",
            toolName: "lookup",
            toolCallId: "call_2",
            state: "output-error",
            input: { q: "Rome" },
            errorText: "offline",
          },
          { type: "tool-weather", toolCallId: "call_3", state: "input-available", input: {} },
          { type: "step-start" },
          { type: "text", text: "Paris is 21." },
        ],
      },
    ]);
    assert.deepEqual(out, [
      { role: "user", content: "Weather in Paris and Rome?" },
      {
        role: "assistant",
        content: "Checking.",
        tool_calls: [
          { id: "call_1", type: "function", function: { name: "weather", arguments: '{"city":"Paris"}' } },
          { id: "call_2", type: "function", function: { name: "lookup", arguments: '{"q":"Rome"}' } },
        ],
      },
      { role: "tool", tool_call_id: "call_1", content: '{"temp":21}' },
      { role: "tool", tool_call_id: "call_2", content: "offline" },
      { role: "assistant", content: "Paris is 21." },
    ]);
  });

  test("text after results without a step-start is the next turn; a string result as is", () => {
    const out = toRelayMessages([
      {
        id: "a",
        role: "assistant",
        parts: [
          { type: "tool-now", toolCallId: "c", state: "output-available", input: {}, output: "noon" },
          { type: "text", text: "It is noon." },
        ],
      },
    ]);
    assert.deepEqual(out, [
      {
        role: "assistant",
        content: null,
        tool_calls: [{ id: "c", type: "function", function: { name: "now", arguments: "{}" } }],
      },
      { role: "tool", tool_call_id: "c", content: "noon" },
      { role: "assistant", content: "It is noon." },
    ]);
  });
});

describe("sendMessages", () => {
  test("a generate with the params; resolves at started; chunks of the whole answer", async () => {
    const store = new Map();
    const transport = new TokenRelayChatTransport({
      client: connected(),
      store,
      params: { temperature: 0, max_tokens: 32 },
    });
    const stream = await send(transport, [user("Hi")], { body: { params: { max_tokens: 8 } } });
    const [frame] = FakeWebSocket.last().sentOfType("generate");
    assert.deepEqual(frame.messages, [{ role: "user", content: "Hi" }]);
    assert.deepEqual(frame.params, { temperature: 0, max_tokens: 8 });
    const id = server.onlyStreamId();
    const entry = store.get("c1");
    assert.equal(entry.streamId, id);
    assert.equal(entry.resumeToken, `tok-${id}`);
    server.finish(id);
    const chunks = await read(stream);
    assert.deepEqual(chunks.slice(0, 3), [
      { type: "start", messageId: entry.messageId },
      { type: "start-step" },
      { type: "text-start", id: `text-${entry.messageId}` },
    ]);
    assert.equal(texts(chunks), server.fullText());
    assert.deepEqual(chunks.slice(-3), [
      { type: "text-end", id: `text-${entry.messageId}` },
      { type: "finish-step" },
      { type: "finish", finishReason: "stop" },
    ]);
    await flush();
    assert.equal(store.has("c1"), false, "the entry goes when the answer ends");
  });

  test("continuing an assistant message (after tool results) keeps its id", async () => {
    const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
    const last = { id: "a7", role: "assistant", parts: [{ type: "text", text: "x" }] };
    const stream = await send(transport, [user("Hi"), last]);
    server.finish(server.onlyStreamId());
    assert.deepEqual((await read(stream))[0], { type: "start", messageId: "a7" });
  });

  test("the done frame's tool calls become tool input chunks, finish tool-calls", async () => {
    const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
    const stream = await send(transport);
    const id = server.onlyStreamId();
    FakeWebSocket.last().push({
      type: "done",
      stream_id: id,
      seq: 1,
      finish_reason: "tool_calls",
      usage: { prompt_tokens: 5, completion_tokens: 9 },
      tool_calls: [
        { id: "call_a", type: "function", function: { name: "weather", arguments: '{"city":"Oslo"}' } },
        { id: "call_b", type: "function", function: { name: "weather", arguments: "{oops" } },
      ],
    });
    const chunks = await read(stream);
    assert.deepEqual(chunks.slice(2), [
      { type: "tool-input-available", toolCallId: "call_a", toolName: "weather", input: { city: "Oslo" } },
      {
        type: "tool-input-error",
        toolCallId: "call_b",
        toolName: "weather",
        input: "{oops",
        errorText: "the model's arguments are not JSON: {oops",
      },
      { type: "finish-step" },
      { type: "finish", finishReason: "tool-calls" },
    ]);
  });

  test("a call streams as tool-input-start and deltas; done's list makes it available", async () => {
    server = new FakeServer(toolAnswer());
    const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
    const stream = await send(transport);
    server.finish(server.onlyStreamId());
    const chunks = await read(stream);
    assert.deepEqual(chunks.slice(1), toolChunks(chunks[2].id));
  });

  test("a call begun but cut off (left out of done's list) ends in a tool-input-error", async () => {
    const { chunks: [, head, more] } = toolAnswer();
    server = new FakeServer({ chunks: [head, more], end: { finish_reason: "length" } });
    const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
    const stream = await send(transport);
    server.finish(server.onlyStreamId());
    assert.deepEqual((await read(stream)).slice(2), [
      { type: "tool-input-start", toolCallId: "call_1", toolName: "get_weather" },
      { type: "tool-input-delta", toolCallId: "call_1", inputTextDelta: '{"city": ' },
      {
        type: "tool-input-error",
        toolCallId: "call_1",
        toolName: "get_weather",
        input: '{"city": ',
        errorText: "the call was cut off before it was complete",
      },
      { type: "finish-step" },
      { type: "finish", finishReason: "length" },
    ]);
  });

  test("text after a call is a text part of its own", async () => {
    const { chunks: answer, end } = toolAnswer();
    server = new FakeServer({ chunks: [...answer, "Done."], end });
    const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
    const stream = await send(transport);
    server.finish(server.onlyStreamId());
    const chunks = await read(stream);
    const ids = chunks.filter((c) => c.type === "text-start").map((c) => c.id);
    assert.equal(new Set(ids).size, 2);
    assert.deepEqual(chunks.slice(8, 11), [
      { type: "text-start", id: ids[1] },
      { type: "text-delta", id: ids[1], delta: "Done." },
      { type: "text-end", id: ids[1] },
    ]);
  });

  test("finish reasons: length, cancelled and expired are other; error an error chunk", async () => {
    const seen = [];
    for (const reason of ["length", "cancelled", "expired", "error"]) {
      const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
      const stream = await send(transport);
      const id = server.onlyStreamId();
      server.emit(id, 1);
      const done = { type: "done", stream_id: id, seq: 2, finish_reason: reason, usage: null };
      if (reason === "error") done.message = "engine worker shut down";
      FakeWebSocket.last().push(done);
      seen.push((await read(stream)).slice(-1)[0]);
    }
    assert.deepEqual(seen, [
      { type: "finish", finishReason: "length" },
      { type: "finish", finishReason: "other" },
      { type: "finish", finishReason: "other" },
      { type: "error", errorText: "engine worker shut down" },
    ]);
  });

  test("a refused generate rejects with a TokenRelayError; nothing is stored", async () => {
    const store = new Map();
    const transport = new TokenRelayChatTransport({ client: connected(), store });
    const receive = server.receive.bind(server);
    server.receive = (ws, f) => {
      if (f.type !== "generate") return receive(ws, f);
      ws.push({ type: "error", code: "too_large", message: "too many messages", request_id: f.request_id });
    };
    await assert.rejects(send(transport), (err) => {
      assert.ok(err instanceof TokenRelayError);
      assert.equal(err.code, "too_large");
      return true;
    });
    assert.equal(store.size, 0);
  });

  test("an error mid-answer ends the chunks with an error chunk", async () => {
    const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
    const stream = await send(transport);
    const id = server.onlyStreamId();
    server.emit(id, 2);
    FakeWebSocket.last().push({ type: "error", code: "not_found", message: "expired", stream_id: id });
    const chunks = await read(stream);
    assert.equal(texts(chunks), "Hello");
    assert.deepEqual(chunks.slice(-2), [
      { type: "text-end", id: chunks[2].id },
      { type: "error", errorText: "expired" },
    ]);
  });

  test("abortSignal cancels the generation (a cancel frame, then done cancelled)", async () => {
    const store = new Map();
    const transport = new TokenRelayChatTransport({ client: connected(), store });
    const controller = new AbortController();
    const stream = await send(transport, undefined, { abortSignal: controller.signal });
    const id = server.onlyStreamId();
    server.emit(id, 2);
    controller.abort();
    assert.deepEqual(FakeWebSocket.last().sentOfType("cancel"), [{ type: "cancel", stream_id: id, resume_token: `tok-${id}` }]);
    server.emit(id, 1); // the server's done: cancelled
    await read(stream);
    await flush();
    assert.equal(store.has("c1"), false);
  });

  test("an abort before started rejects with the reason and cancels after started", async () => {
    const store = new Map();
    const transport = new TokenRelayChatTransport({ client: connected(), store });
    const receive = server.receive.bind(server);
    const held = [];
    server.receive = (ws, f) => (f.type === "generate" ? held.push([ws, f]) : receive(ws, f));
    const controller = new AbortController();
    const sending = send(transport, undefined, { abortSignal: controller.signal });
    controller.abort();
    await assert.rejects(sending, { name: "AbortError" });
    receive(...held[0]); // the gateway starts it: the cancel follows
    const id = server.onlyStreamId();
    assert.deepEqual(FakeWebSocket.last().sentOfType("cancel"), [
      { type: "cancel", stream_id: id, resume_token: `tok-${id}` },
    ]);
    assert.equal(store.size, 0);
  });

  test("an abort before the socket opened sends nothing", async () => {
    const transport = new TokenRelayChatTransport({ client: makeClient(), store: new Map() });
    const controller = new AbortController();
    const sending = send(transport, undefined, { abortSignal: controller.signal });
    controller.abort();
    await assert.rejects(sending, { name: "AbortError" });
    server.connect(FakeWebSocket.last());
    assert.deepEqual(FakeWebSocket.last().sent, []);
  });

  test("an already aborted signal sends nothing at all", async () => {
    const transport = new TokenRelayChatTransport({ client: makeClient(), store: new Map() });
    await assert.rejects(send(transport, undefined, { abortSignal: AbortSignal.abort() }), {
      name: "AbortError",
    });
    assert.equal(FakeWebSocket.instances.length, 0);
  });

  test("a stream the AI SDK stops reading keeps going and stays resumable", async () => {
    const store = new Map();
    const transport = new TokenRelayChatTransport({ client: connected(), store });
    const stream = await send(transport);
    const id = server.onlyStreamId();
    server.emit(id, 2);
    await stream.cancel();
    assert.equal(FakeWebSocket.last().sentOfType("cancel").length, 0);
    assert.equal(store.get("c1").streamId, id);
    const again = await transport.reconnectToStream({ chatId: "c1" });
    server.finish(id);
    assert.equal(texts(await read(again)), server.fullText(), "from the first token");
  });
});

describe("reconnectToStream", () => {
  test("null when the chat has no answer in flight", async () => {
    const transport = new TokenRelayChatTransport({ client: makeClient(), store: new Map() });
    assert.equal(await transport.reconnectToStream({ chatId: "nope" }), null);
    assert.equal(FakeWebSocket.instances.length, 0, "not even a connection");
  });

  test("after a reload: resumes from seq 0 and replays the whole answer", async () => {
    const store = new Map();
    const before = new TokenRelayChatTransport({ client: connected(), store });
    await send(before);
    const id = server.onlyStreamId();
    const { messageId } = store.get("c1");
    server.emit(id, 3);
    before.client.close(); // the page goes
    server.emit(id, 1); // the answer goes on meanwhile

    const after = new TokenRelayChatTransport({ client: makeClient(), store });
    const reconnecting = after.reconnectToStream({ chatId: "c1" });
    await flush(); // the store's answer, then the resume and a socket for it
    server.connect(FakeWebSocket.last());
    assert.deepEqual(FakeWebSocket.last().sentOfType("resume"), [
      { type: "resume", stream_id: id, resume_token: `tok-${id}`, after: 0 },
    ]);
    const stream = await reconnecting;
    assert.ok(stream);
    server.finish(id);
    const chunks = await read(stream);
    assert.deepEqual(chunks[0], { type: "start", messageId }, "the same message id");
    assert.equal(texts(chunks), server.fullText());
    assert.deepEqual(chunks.at(-1), { type: "finish", finishReason: "stop" });
    await flush();
    assert.equal(store.has("c1"), false);
    assert.equal(await after.reconnectToStream({ chatId: "c1" }), null, "finished: null");
  });

  test("a reload mid-call replays the same chunks as an uninterrupted answer", async () => {
    server = new FakeServer(toolAnswer());
    const store = new Map();
    const before = new TokenRelayChatTransport({ client: connected(), store });
    await send(before);
    const id = server.onlyStreamId();
    const { messageId } = store.get("c1");
    server.emit(id, 3); // the call's first two entries
    before.client.close();
    const after = new TokenRelayChatTransport({ client: makeClient(), store });
    const reconnecting = after.reconnectToStream({ chatId: "c1" });
    await flush();
    server.connect(FakeWebSocket.last());
    const stream = await reconnecting;
    server.finish(id);
    const chunks = await read(stream);
    assert.deepEqual(chunks[0], { type: "start", messageId });
    assert.deepEqual(chunks.slice(1), toolChunks(chunks[2].id));
  });

  test("a stream left mid-call and reconnected gives the call so far first", async () => {
    server = new FakeServer(toolAnswer());
    const transport = new TokenRelayChatTransport({ client: connected(), store: new Map() });
    const left = await send(transport);
    const id = server.onlyStreamId();
    server.emit(id, 3);
    await left.cancel(); // the AI SDK stops reading; the answer goes on
    const again = await transport.reconnectToStream({ chatId: "c1" });
    server.finish(id);
    const chunks = await read(again);
    assert.deepEqual(chunks.slice(1), toolChunks(chunks[2].id));
  });

  test("null, and the entry dropped, when the gateway no longer has the stream", async () => {
    const store = new Map([["c1", { streamId: "gone", resumeToken: "t", messageId: "m" }]]);
    const transport = new TokenRelayChatTransport({ client: connected(), store });
    assert.equal(await transport.reconnectToStream({ chatId: "c1" }), null);
    await flush();
    assert.equal(store.has("c1"), false);
  });

  test("abort stops the answer; a second resume at once (StrictMode) only supersedes", async () => {
    const store = new Map();
    const first = new TokenRelayChatTransport({ client: connected(), store });
    await send(first);
    const id = server.onlyStreamId();
    server.emit(id, 2);
    first.client.close();

    const transport = new TokenRelayChatTransport({ client: connected(), store });
    const a = new AbortController();
    const one = await transport.reconnectToStream({ chatId: "c1", abortSignal: a.signal });
    a.abort(); // the AI SDK aborts the first resume when a second one starts...
    const b = new AbortController();
    const two = await transport.reconnectToStream({ chatId: "c1", abortSignal: b.signal });
    await flush();
    const ws = FakeWebSocket.last();
    assert.equal(ws.sentOfType("cancel").length, 0, "a superseded resume cancels nothing");
    assert.equal(ws.sentOfType("resume").length, 1, "the second rides on the first's stream");
    await one.cancel();
    server.emit(id, 1);
    b.abort(); // ...and Stop aborts the current one
    await flush();
    assert.deepEqual(ws.sentOfType("cancel"), [{ type: "cancel", stream_id: id, resume_token: `tok-${id}` }]);
    server.emit(id, 1);
    const chunks = await read(two);
    assert.equal(texts(chunks), "Hello, ", "from the first token, up to the cancel");
    assert.deepEqual(chunks.at(-1), { type: "finish", finishReason: "other" });
  });
});

describe("stores", () => {
  test("webStorageStore: one JSON key per chat; storage errors are ignored", () => {
    const items = new Map();
    const storage = {
      getItem: (k) => items.get(k) ?? null,
      setItem: (k, v) => items.set(k, String(v)),
      removeItem: (k) => items.delete(k),
    };
    const store = webStorageStore(storage, "p:");
    const entry = { streamId: "s", resumeToken: "t", messageId: "m" };
    store.set("c1", entry);
    assert.equal(items.get("p:c1"), JSON.stringify(entry));
    assert.deepEqual(store.get("c1"), entry);
    items.set("p:c2", "{not json");
    assert.equal(store.get("c2"), null);
    store.delete("c1");
    assert.equal(store.get("c1"), null);
    const broken = webStorageStore({
      getItem: () => {
        throw new Error("denied");
      },
      setItem: () => {
        throw new Error("quota");
      },
      removeItem: () => {
        throw new Error("denied");
      },
    });
    broken.set("c", entry);
    broken.delete("c");
    assert.equal(broken.get("c"), null);
  });

  test("the default store is localStorage in a page, memory elsewhere", () => {
    const transport = new TokenRelayChatTransport({ client: makeClient() });
    assert.ok(transport.store instanceof Map);
    const items = new Map();
    globalThis.window = {
      localStorage: {
        getItem: (k) => items.get(k) ?? null,
        setItem: (k, v) => items.set(k, v),
        removeItem: (k) => items.delete(k),
      },
    };
    try {
      const paged = new TokenRelayChatTransport({ client: makeClient() });
      paged.store.set("c1", { streamId: "s", resumeToken: "t", messageId: "m" });
      assert.deepEqual([...items.keys()], ["tokenrelay.ai-sdk.v1:c1"]);
    } finally {
      delete globalThis.window;
    }
  });

  test("an async store works too", async () => {
    const map = new Map();
    const store = {
      get: async (k) => map.get(k),
      set: async (k, v) => void map.set(k, v),
      delete: async (k) => void map.delete(k),
    };
    const transport = new TokenRelayChatTransport({ client: connected(), store });
    const stream = await send(transport);
    assert.equal(map.get("c1").streamId, server.onlyStreamId());
    server.finish(server.onlyStreamId());
    assert.equal(texts(await read(stream)), server.fullText());
    await flush();
    assert.equal(map.size, 0);
  });

  test("url makes a client for that gateway", () => {
    const transport = new TokenRelayChatTransport({ url: "https://gw.test", clientOptions: { window: null } });
    assert.equal(transport.client.url, "wss://gw.test/v1/ws");
    assert.equal(transport.resumeStreamIsReplay, true);
  });
});
