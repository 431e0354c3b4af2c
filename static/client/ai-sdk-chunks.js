// The UIMessageChunks of a TokenRelayStream, for TokenRelayChatTransport
// (tokenrelay-ai-sdk.js): the stream's events mapped to the chunks the Vercel AI SDK (`ai` >=
// 5) reads. Imports nothing from `ai`. Internal module: use tokenrelay-ai-sdk.js.

/**
 * @typedef {import("ai").UIMessageChunk} UIMessageChunk
 * @typedef {import("../tokenrelay-client.js").TokenRelayStream} TokenRelayStream
 * @typedef {import("../tokenrelay-client.js").ToolCall} ToolCall
 */

/** @type {Record<string, "stop"|"length"|"tool-calls">} ours → the AI SDK's (else "other") */
const FINISH = { stop: "stop", length: "length", tool_calls: "tool-calls" };

/**
 * The UIMessageChunks of a stream, from its first token (what it already holds comes first:
 * its text, then the calls begun): start, text, each call as it streams (`tool-input-start`
 * at its first entry, a `tool-input-delta` per arguments fragment), then at the end the
 * `done` frame's calls (`tool-input-available`, or `tool-input-error` for arguments that are
 * no JSON and for a call begun but left out of that list: cut off), finish; or an error
 * chunk. Cancelling the ReadableStream only stops reading (the answer keeps going and stays
 * resumable).
 * @param {TokenRelayStream} relay
 * @param {string} messageId
 * @returns {ReadableStream<UIMessageChunk>}
 */
export function chunks(relay, messageId) {
  /** @type {() => void} */
  let stop = () => {};
  return new ReadableStream({
    start(controller) {
      let parts = 0;
      /** @type {string|null} the text part open */
      let open = null;
      /** @type {Map<string, {name: string, args: string}>} the calls begun, by id */
      const begun = new Map();
      /** @param {UIMessageChunk} chunk */
      const put = (chunk) => controller.enqueue(chunk);
      const end = () => {
        if (open) put({ type: "text-end", id: open });
        open = null;
      };
      /** @param {string} delta */
      const text = (delta) => {
        if (!delta) return;
        if (!open) {
          open = parts++ ? `text-${messageId}-${parts}` : `text-${messageId}`;
          put({ type: "text-start", id: open });
        }
        put({ type: "text-delta", id: open, delta });
      };
      /** @param {{id: string, name: string, argumentsDelta: string}} call */
      const toolInput = (call) => {
        const toolCallId = call.id;
        if (!begun.has(toolCallId)) {
          end(); // text after the call is a part of its own
          begun.set(toolCallId, { name: call.name, args: "" });
          put({ type: "tool-input-start", toolCallId, toolName: call.name });
        }
        const held = /** @type {{name: string, args: string}} */ (begun.get(toolCallId));
        held.args += call.argumentsDelta;
        if (call.argumentsDelta) {
          put({ type: "tool-input-delta", toolCallId, inputTextDelta: call.argumentsDelta });
        }
      };
      /** @param {string} errorText */
      const cutOff = (errorText) => {
        for (const [toolCallId, { name, args }] of begun) {
          put({ type: "tool-input-error", toolCallId, toolName: name, input: args, errorText });
        }
        begun.clear();
      };
      /** @param {{finishReason?: string|null, message?: string, toolCalls?: ToolCall[]}} d */
      const finish = (d) => {
        end();
        for (const call of d.toolCalls ?? []) {
          const tool = { toolCallId: call.id, toolName: call.function.name };
          const args = call.function.arguments;
          begun.delete(call.id);
          try {
            put({ type: "tool-input-available", ...tool, input: JSON.parse(args) });
          } catch {
            const errorText = `the model's arguments are not JSON: ${args}`;
            put({ type: "tool-input-error", ...tool, input: args, errorText });
          }
        }
        cutOff("the call was cut off before it was complete");
        if (d.finishReason === "error") {
          put({ type: "error", errorText: d.message ?? "the answer could not finish" });
        } else {
          put({ type: "finish-step" });
          put({ type: "finish", finishReason: FINISH[d.finishReason ?? ""] ?? "other" });
        }
        stop();
        controller.close();
      };
      /** @param {{message: string}} error */
      const fail = (error) => {
        end();
        cutOff(error.message);
        put({ type: "error", errorText: error.message });
        stop();
        controller.close();
      };
      /** @param {Event} e @returns {any} */
      const detail = (e) => /** @type {CustomEvent} */ (e).detail;
      /** @param {Event} e */
      const onToken = (e) => text(detail(e).text);
      /** @param {Event} e */
      const onToolCall = (e) => toolInput(detail(e));
      /** @param {Event} e */
      const onDone = (e) => finish(detail(e));
      /** @param {Event} e */
      const onError = (e) => fail(detail(e));
      const events = /** @type {const} */ ([
        ["token", onToken],
        ["tool-call", onToolCall],
        ["done", onDone],
        ["error", onError],
      ]);
      stop = () => {
        for (const [name, on] of events) relay.removeEventListener(name, on);
      };
      put({ type: "start", messageId });
      put({ type: "start-step" });
      text(relay.text);
      if (relay.error) fail(relay.error);
      else if (relay.closed) {
        finish({ finishReason: relay.finishReason, toolCalls: relay.toolCalls });
      } else {
        for (const call of relay.toolCalls) {
          const { name, arguments: args } = call.function;
          toolInput({ id: call.id, name, argumentsDelta: args });
        }
        for (const [name, on] of events) relay.addEventListener(name, on);
      }
    },
    cancel() {
      stop();
    },
  });
}
