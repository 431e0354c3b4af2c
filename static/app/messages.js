// The chat page's message list: each message as an element (user text as text, answers as
// sanitised Markdown with highlighted code, their figures, Copy, Regenerate and Edit), kept in
// line with the current conversation, streaming answers re-rendered at most once a frame, a
// user message edited in place, and what the live region says when an answer ends.

import { highlightCode } from "../highlight.js";
import { copyText, decorateCodeBlocks, renderMarkdown } from "../markdown.js";
import { $, announce, button, messagesEl, nearBottom, scrollToBottom } from "./dom.js";
import { editorForm } from "./editor.js";
import { current, findMessage, state } from "./state.js";

/**
 * @typedef {import("./state.js").Msg} Msg
 * @typedef {import("./state.js").Conversation} Conversation
 */

/** Markdown options for answers: code blocks are highlighted. */
const MARKDOWN = { highlight: highlightCode };
/** Longest answer text the live region reads out (characters); longer ones are cut. */
const MAX_ANNOUNCED_CHARS = 1000;

/** What Regenerate and the editor's Save do (answers.js; set by the page, app.js). */
const actions = {
  /** @type {(convId: string, msgId: string) => void} */
  regenerate: () => {},
  /** @type {(convId: string, msgId: string, text: string) => void} */
  saveEdit: () => {},
};

/** @param {Partial<typeof actions>} handlers */
export function setMessageActions(handlers) {
  Object.assign(actions, handlers);
}

/**
 * What the live region says when an answer ends: its text (as read, without Markdown marks;
 * cut after MAX_ANNOUNCED_CHARS), or that it was stopped or failed.
 * @param {Msg} m
 */
export function answerAnnouncement(m) {
  const plain = (renderMarkdown(m.content).textContent ?? "").replace(/\s+/g, " ").trim();
  const text = plain.length > MAX_ANNOUNCED_CHARS ? `${plain.slice(0, MAX_ANNOUNCED_CHARS)}...` : plain;
  if (m.state === "error") return `The answer failed: ${m.error || "something went wrong"}.${text ? ` Partial answer: ${text}` : ""}`;
  if (m.state === "cancelled") return text ? `Answer stopped: ${text}` : "Answer stopped.";
  return `Answer: ${text || "(empty)"}`;
}

function formatMeta(meta, msg) {
  const parts = [];
  if (meta?.ttftMs != null) parts.push(`TTFT ${Math.round(meta.ttftMs)} ms`);
  if (meta?.tokensPerSec != null) parts.push(`${meta.tokensPerSec.toFixed(1)} tokens/s`);
  if (meta?.completionTokens != null) parts.push(`${meta.completionTokens} tokens`);
  if (meta?.resumed) parts.push(`resumed ${meta.resumed}x`);
  if (msg.state === "cancelled") parts.push("stopped");
  if (msg.state === "done" && meta?.finishReason === "length") parts.push("hit max tokens");
  return parts.join(" \u00b7 ");
}

/** @param {Msg} msg @param {Conversation} conv */
function messageElement(msg, conv) {
  const el = document.createElement("article");
  el.className = `message message-${msg.role}`;
  el.dataset.testid = "message";
  el.dataset.role = msg.role;
  el.dataset.id = msg.id;
  const label = document.createElement("h3");
  label.className = "visually-hidden";
  label.textContent = msg.role === "user" ? "You said:" : "Assistant:";
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  const content = document.createElement("div");
  content.className = msg.role === "user" ? "content plain" : "content markdown";
  content.dataset.testid = "message-content";
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.dataset.testid = "message-meta";
  const buttons = document.createElement("div");
  buttons.className = "actions";
  bubble.append(content);
  el.append(label, bubble);
  if (msg.role === "user") {
    const edit = button({
      className: "btn btn-small",
      testid: "edit",
      text: "Edit",
      label: "Edit this message and answer it again",
      onClick: () => startEditing(conv.id, msg.id),
    });
    buttons.append(edit);
    el.append(buttons);
  } else {
    const copy = button({
      className: "btn btn-small",
      testid: "copy",
      text: "Copy",
      label: "Copy this answer",
    });
    copy.addEventListener("click", async () => {
      const m = findMessage(conv.id, msg.id);
      const ok = await copyText(m?.content ?? "");
      copy.textContent = ok ? "Copied" : "Copy failed";
      announce(ok ? "Answer copied" : "Could not copy");
      setTimeout(() => {
        copy.textContent = "Copy";
      }, 1500);
    });
    const regen = button({
      className: "btn btn-small",
      testid: "regenerate",
      text: "Regenerate",
      label: "Regenerate this answer",
      title: "Answer again from here (the messages after this answer are removed)",
      onClick: () => actions.regenerate(conv.id, msg.id),
    });
    buttons.append(copy, regen);
    bubble.append(meta, buttons);
  }
  updateMessageElement(el, msg, conv);
  return el;
}

/** @param {HTMLElement} el @param {Msg} msg @param {Conversation} conv */
export function updateMessageElement(el, msg, conv) {
  const msgState = msg.role === "user" ? "done" : (msg.state ?? "done");
  el.dataset.state = msgState;
  const content = /** @type {HTMLElement} */ (el.querySelector(".content"));
  if (msg.role === "user") {
    if (state.editing?.msgId === msg.id) showEditor(el, msg, conv);
    else {
      el.querySelector(".editor")?.remove();
      delete el.dataset.editing;
      content.hidden = false;
      content.textContent = msg.content; // never HTML
    }
  } else {
    content.setAttribute("aria-busy", msgState === "streaming" ? "true" : "false");
    content.replaceChildren(renderMarkdown(msg.content, MARKDOWN));
    if (msgState === "streaming") {
      const caret = document.createElement("span");
      caret.className = "caret";
      caret.setAttribute("aria-hidden", "true");
      (content.lastElementChild ?? content).append(caret);
    } else {
      decorateCodeBlocks(content, copyText);
    }
    if (msgState === "error") {
      const err = document.createElement("p");
      err.className = "error-text";
      err.dataset.testid = "message-error";
      err.textContent = msg.error || "Something went wrong.";
      content.append(err);
    }
    const meta = /** @type {HTMLElement} */ (el.querySelector(".meta"));
    meta.textContent = formatMeta(msg.meta, msg);
    if (msg.meta?.ttftMs != null) meta.dataset.ttftMs = String(Math.round(msg.meta.ttftMs));
    if (msg.meta?.tokensPerSec != null) meta.dataset.tokensPerSec = msg.meta.tokensPerSec.toFixed(2);
    // any answer can be regenerated; the messages after it are dropped (docs/client.md)
    const regen = /** @type {HTMLElement} */ (el.querySelector("[data-testid=regenerate]"));
    regen.hidden = msgState === "streaming";
    const copy = /** @type {HTMLElement} */ (el.querySelector("[data-testid=copy]"));
    copy.hidden = msgState === "streaming";
  }
}

/** Show the current conversation's messages (all of them anew). */
export function renderMessages() {
  const conv = current();
  const items = conv?.messages ?? [];
  $("empty-state").hidden = items.length > 0;
  for (const el of messagesEl.querySelectorAll("[data-testid=message]")) el.remove();
  if (!conv) return;
  for (const msg of items) messagesEl.append(messageElement(msg, conv));
  scrollToBottom();
}

/**
 * Bring the shown messages in line with `conv` without touching the ones that stay: drop the
 * elements of removed messages, append the new ones (messages are only ever added at the end).
 * @param {Conversation} conv
 */
export function syncMessages(conv) {
  if (conv.id !== state.currentId) return;
  const ids = new Set(conv.messages.map((m) => m.id));
  /** @type {Set<string>} */
  const shown = new Set();
  for (const el of messagesEl.querySelectorAll("[data-testid=message]")) {
    const id = /** @type {HTMLElement} */ (el).dataset.id ?? "";
    if (ids.has(id)) shown.add(id);
    else el.remove();
  }
  for (const m of conv.messages) if (!shown.has(m.id)) messagesEl.append(messageElement(m, conv));
  $("empty-state").hidden = conv.messages.length > 0;
}

/** @param {string} msgId */
export function messageEl(msgId) {
  return /** @type {HTMLElement|null} */ (messagesEl.querySelector(`[data-id="${CSS.escape(msgId)}"]`));
}

// Streaming text is re-rendered at most once per frame.
const dirty = new Set();
let flushScheduled = false;
/** @param {string} convId @param {string} msgId */
export function scheduleRender(convId, msgId) {
  dirty.add(`${convId}\u0000${msgId}`);
  if (flushScheduled) return;
  flushScheduled = true;
  const flush = () => {
    if (!flushScheduled) return;
    flushScheduled = false;
    const stick = nearBottom();
    for (const key of dirty) {
      const [cId, mId] = key.split("\u0000");
      if (cId !== state.currentId) continue;
      const el = messagesEl.querySelector(`[data-id="${CSS.escape(mId)}"]`);
      const msg = findMessage(cId, mId);
      if (el && msg) updateMessageElement(/** @type {HTMLElement} */ (el), msg, state.convs.items[cId]);
    }
    dirty.clear();
    if (stick) scrollToBottom();
  };
  requestAnimationFrame(flush);
  setTimeout(flush, 100); // background tabs get no animation frames
}

// --- editing a user message --------------------------------------------------------------

/** @param {HTMLElement} el @param {Msg} msg @param {Conversation} conv */
function showEditor(el, msg, conv) {
  const content = /** @type {HTMLElement} */ (el.querySelector(".content"));
  content.hidden = true;
  el.dataset.editing = "true";
  if (el.querySelector(".editor")) return;
  const form = editorForm(state.editing?.draft ?? msg.content, {
    input: (text) => {
      if (state.editing) state.editing.draft = text;
    },
    save: (text) => actions.saveEdit(conv.id, msg.id, text),
    cancel: () => cancelEditing(),
  });
  content.after(form);
}

/** @param {string} convId @param {string} msgId */
function startEditing(convId, msgId) {
  if (state.active) return;
  const msg = findMessage(convId, msgId);
  if (!msg || msg.role !== "user") return;
  if (state.editing) cancelEditing(false);
  state.editing = { convId, msgId, draft: msg.content };
  const el = messageEl(msgId);
  if (!el) return;
  updateMessageElement(el, msg, state.convs.items[convId]);
  const box = /** @type {HTMLTextAreaElement|null} */ (el.querySelector("[data-testid=edit-box]"));
  box?.focus();
  box?.setSelectionRange(box.value.length, box.value.length);
}

/** Close the editor without saving. @param {boolean} [refocus] give focus back to its Edit button */
export function cancelEditing(refocus = true) {
  const was = state.editing;
  state.editing = null;
  if (!was) return;
  const el = messageEl(was.msgId);
  const msg = findMessage(was.convId, was.msgId);
  if (!el || !msg) return;
  delete el.dataset.editing;
  updateMessageElement(el, msg, state.convs.items[was.convId]);
  if (refocus) /** @type {HTMLElement|null} */ (el.querySelector("[data-testid=edit]"))?.focus();
}
