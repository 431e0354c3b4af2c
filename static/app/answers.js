// The chat page's answers: send a message, regenerate an answer or save an edited message
// (truncate and regenerate), stream the answer into its message while saving every token
// (so a reload resumes at the right seq), finish it (figures, the live region), Stop, and
// after a reload re-attach every answer that was streaming.

import { client } from "./connection.js";
import {
  announce,
  autosize,
  composer,
  focusComposer,
  scrollToBottom,
  setBusy,
  stopBtn,
} from "./dom.js";
import {
  answerAnnouncement,
  cancelEditing,
  messageEl,
  scheduleRender,
  syncMessages,
  updateMessageElement,
} from "./messages.js";
import { generationParams } from "./settings.js";
import { renderConversationList } from "./sidebar.js";
import {
  current,
  findMessage,
  KEY,
  newConversation,
  saveConversations,
  saveInflight,
  state,
  storage,
  titleOf,
  uid,
} from "./state.js";
import { flashResumed, updateDebug } from "./status.js";

/**
 * @typedef {import("./state.js").Msg} Msg
 * @typedef {import("./state.js").Conversation} Conversation
 * @typedef {import("./state.js").Inflight} Inflight
 */

/** The messages sent for an answer: the system prompt, then the conversation up to there. */
function historyFor(conv, uptoIndex) {
  /** @type {{role: string, content: string}[]} */
  const out = [];
  const { system } = generationParams();
  if (system) out.push({ role: "system", content: system });
  for (const m of conv.messages.slice(0, uptoIndex)) {
    if (m.role === "assistant" && (m.state === "error" || !m.content)) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

// An answer keeps generating while the page is away (a locked phone, a hidden tab) for
// 5 minutes, so that it can be resumed: the gateway's default when longer, its most when
// shorter (both in its hello; docs/protocol.md, `detach_timeout`).
const DETACH_TIMEOUT_S = 300;

/** The `detach_timeout` param of a generate, in seconds. */
function detachTimeout() {
  /** @type {Record<string, unknown>} */
  const hello = client.hello ?? {};
  const most = Number(hello.max_detach_timeout) || Infinity;
  return Math.min(Math.max(DETACH_TIMEOUT_S, Number(hello.detach_timeout) || 0), most);
}

function startAnswer(conv, history) {
  const { params } = generationParams();
  /** @type {Msg} */
  const msg = {
    id: uid("m"),
    role: "assistant",
    content: "",
    state: "streaming",
    meta: { params },
    createdAt: Date.now(),
  };
  conv.messages.push(msg);
  conv.updatedAt = Date.now();
  saveConversations();
  const stream = client.generate({
    messages: history,
    params: { ...params, detach_timeout: detachTimeout() },
  });
  /** @type {Inflight} */
  const record = {
    convId: conv.id,
    msgId: msg.id,
    streamId: null,
    resumeToken: null,
    lastSeq: 0,
    text: "",
    sentAt: Date.now(),
    firstTokenAt: null,
    tokens: 0,
    resumes: 0,
  };
  state.inflight[msg.id] = record;
  saveInflight();
  follow(stream, record);
  syncMessages(conv);
  scrollToBottom();
}

/**
 * Wire a stream to its message: persist every token (so a reload resumes at the right seq),
 * render, and finish the message on done/error.
 * @param {import("../tokenrelay-client.js").TokenRelayStream} stream @param {Inflight} record
 */
function follow(stream, record) {
  state.active = { stream, record };
  setBusy(true);
  updateDebug();
  const msg = () => findMessage(record.convId, record.msgId);
  stream.addEventListener("started", (e) => {
    record.streamId = e.detail.streamId;
    record.resumeToken = e.detail.resumeToken;
    saveInflight();
    updateDebug();
  });
  stream.addEventListener("token", (e) => {
    if (record.firstTokenAt == null) record.firstTokenAt = Date.now();
    record.lastSeq = e.detail.seq;
    record.text = e.detail.fullText;
    record.tokens += 1;
    saveInflight();
    const m = msg();
    if (m) m.content = record.text;
    scheduleRender(record.convId, record.msgId);
    updateDebug();
  });
  stream.addEventListener("resumed", () => {
    record.resumes += 1;
    saveInflight();
    flashResumed();
    updateDebug();
  });
  stream.addEventListener("done", (e) => {
    const { finishReason, usage } = e.detail;
    const m = msg();
    if (m) {
      const now = Date.now();
      m.content = stream.text;
      m.state =
        finishReason === "cancelled"
          ? "cancelled"
          : finishReason === "error" || finishReason === "expired"
            ? "error"
            : "done";
      if (m.state === "error") {
        m.error =
          finishReason === "expired"
            ? "The answer expired before it finished."
            : e.detail.message || "The engine failed while answering.";
      }
      const n = usage?.completion_tokens ?? record.tokens;
      const first = record.firstTokenAt;
      const decodeS = first != null ? (now - first) / 1000 : 0;
      m.meta = {
        ...(m.meta ?? {}),
        finishReason,
        completionTokens: n,
        ttftMs: first != null ? first - record.sentAt : null,
        tokensPerSec: n > 1 && decodeS > 0 ? (n - 1) / decodeS : null,
        resumed: record.resumes || undefined,
        streamId: record.streamId,
      };
    }
    finishActive(record, m?.state === "cancelled" ? "Answer stopped" : "Answer complete");
  });
  stream.addEventListener("error", (e) => {
    const m = msg();
    if (m) {
      m.content = stream.text;
      m.state = "error";
      m.error =
        e.detail.code === "not_found"
          ? "This answer is no longer available (expired)."
          : `${e.detail.message} (${e.detail.code})`;
    }
    finishActive(record, "The answer failed");
  });
}

function finishActive(record, announcement) {
  delete state.inflight[record.msgId];
  saveInflight();
  const conv = state.convs.items[record.convId];
  if (conv) conv.updatedAt = Date.now();
  saveConversations();
  const hadFocus = document.activeElement === stopBtn;
  if (state.active?.record === record) state.active = null;
  setBusy(false);
  const m = findMessage(record.convId, record.msgId);
  // only this answer is re-rendered: the others stay as they are
  if (record.convId === state.currentId) {
    const el = messageEl(record.msgId);
    if (el && m && conv) updateMessageElement(el, m, conv);
  }
  announce(m ? answerAnnouncement(m) : announcement);
  if (hadFocus) composer.focus();
  updateDebug();
}

/** Send the message box's text (held until a worker is ready, and while an answer streams). */
export function send() {
  const text = composer.value.trim();
  if (!text || state.active || !client.workerReady) return; // held until a worker is ready
  let conv = current();
  if (!conv) {
    conv = newConversation();
    state.currentId = conv.id;
    storage.set(KEY.current, conv.id);
  }
  if (conv.messages.length === 0) conv.title = titleOf(text);
  conv.messages.push({ id: uid("m"), role: "user", content: text, createdAt: Date.now() });
  // move to the top of the list
  state.convs.order = [conv.id, ...state.convs.order.filter((x) => x !== conv.id)];
  composer.value = "";
  autosize();
  startAnswer(conv, historyFor(conv, conv.messages.length));
  renderConversationList();
}

/**
 * Answer again in place of `msgId`: that answer and every message after it are removed
 * (truncate and regenerate), and a new answer streams from the history before it.
 * @param {string} convId @param {string} msgId
 */
export function regenerate(convId, msgId) {
  if (state.active || !client.workerReady) return;
  const conv = state.convs.items[convId];
  if (!conv) return;
  const idx = conv.messages.findIndex((m) => m.id === msgId);
  if (idx < 0 || conv.messages[idx].role !== "assistant") return;
  if (state.editing) cancelEditing(false);
  conv.messages.splice(idx);
  startAnswer(conv, historyFor(conv, conv.messages.length));
  focusComposer();
}

/**
 * Replace a user message and answer again from there: everything after it is removed.
 * @param {string} convId @param {string} msgId @param {string} text
 */
export function saveEdit(convId, msgId, text) {
  const value = text.trim();
  if (!value || state.active || !client.workerReady) return; // held, like the composer
  const conv = state.convs.items[convId];
  const idx = conv ? conv.messages.findIndex((m) => m.id === msgId) : -1;
  if (!conv || idx < 0 || conv.messages[idx].role !== "user") return;
  conv.messages[idx].content = value;
  conv.messages.splice(idx + 1);
  if (idx === 0) conv.title = titleOf(value);
  cancelEditing(false);
  startAnswer(conv, historyFor(conv, conv.messages.length));
  renderConversationList();
  focusComposer();
}

/** Stop the answer being streamed. */
export function stop() {
  if (state.active) state.active.stream.cancel();
}

/** After a reload: re-attach every answer that was streaming. */
export function resumeInflight() {
  for (const record of Object.values(state.inflight)) {
    const m = findMessage(record.convId, record.msgId);
    if (!m) {
      delete state.inflight[record.msgId];
      continue;
    }
    if (!record.streamId || !record.resumeToken) {
      // the page went away before the server said `started`: nothing to resume
      m.state = "error";
      m.error = "The page was reloaded before the answer started.";
      delete state.inflight[record.msgId];
      continue;
    }
    m.content = record.text;
    m.state = "streaming";
    const stream = client.resume({
      streamId: record.streamId,
      resumeToken: record.resumeToken,
      after: record.lastSeq,
      text: record.text,
    });
    follow(stream, record);
  }
  saveInflight();
  saveConversations();
}
