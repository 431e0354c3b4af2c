// The chat page at `/`: conversations in localStorage, streaming Markdown answers (with
// syntax-highlighted code) over TokenRelayClient, Stop / edit / regenerate / copy, the model
// and a connection indicator in the header, keyboard shortcuts, one live region that reads
// each finished answer, and resume after a reload (the in-flight stream's id, resume token,
// last seq and text are saved per token).
// QA hooks (docs/client.md): `?debug=1`, `window.tokenrelay`, stable data-testid selectors.
import { TokenRelayClient, wsTokenFetcher } from "./tokenrelay-client.js";
import { highlightCode } from "./highlight.js";
import { copyText, decorateCodeBlocks, renderMarkdown } from "./markdown.js";

const KEY = {
  conversations: "tokenrelay.v1.conversations",
  current: "tokenrelay.v1.current",
  settings: "tokenrelay.v1.settings",
  inflight: "tokenrelay.v1.inflight",
};

const DEFAULT_SETTINGS = {
  temperature: 0.7,
  max_tokens: 256,
  top_p: 1,
  top_k: 0,
  seed: null,
  system: "",
};
const NUMERIC = ["temperature", "max_tokens", "top_p", "top_k", "seed"];

const STATE_LABELS = {
  idle: "Not connected",
  connecting: "Connecting...",
  open: "Connected",
  reconnecting: "Reconnecting...",
  offline: "Offline: waiting for the network...",
  closed: "Disconnected",
};

const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));

/** Markdown options for answers: code blocks are highlighted. */
const MARKDOWN = { highlight: highlightCode };
/** Longest answer text the live region reads out (characters); longer ones are cut. */
const MAX_ANNOUNCED_CHARS = 1000;

// --- storage -----------------------------------------------------------------------------

const storage = {
  get(key, fallback) {
    try {
      const raw = localStorage.getItem(key);
      return raw == null ? fallback : JSON.parse(raw);
    } catch {
      return fallback;
    }
  },
  set(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch {
      /* quota or disabled storage: the page still works, without persistence */
    }
  },
  remove(key) {
    try {
      localStorage.removeItem(key);
    } catch {
      /* ignore */
    }
  },
};

function uid(prefix) {
  const b = new Uint8Array(8);
  crypto.getRandomValues(b);
  return prefix + Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

/**
 * @typedef {{id: string, role: "user"|"assistant", content: string,
 *   state?: "streaming"|"done"|"cancelled"|"error", error?: string, meta?: object,
 *   createdAt: number}} Msg
 * @typedef {{id: string, title: string, createdAt: number, updatedAt: number,
 *   messages: Msg[]}} Conversation
 * @typedef {{convId: string, msgId: string, requestId?: string, streamId: string|null,
 *   resumeToken: string|null, lastSeq: number, text: string, sentAt: number,
 *   firstTokenAt: number|null, tokens: number, resumes: number}} Inflight
 */

/** @type {{order: string[], items: Record<string, Conversation>}} */
let convs = storage.get(KEY.conversations, { order: [], items: {} });
if (!convs || !Array.isArray(convs.order) || typeof convs.items !== "object") {
  convs = { order: [], items: {} };
}
/** @type {string|null} */
let currentId = storage.get(KEY.current, null);
if (currentId && !convs.items[currentId]) currentId = null;
/** @type {Record<string, Inflight>} */
let inflight = storage.get(KEY.inflight, {}) ?? {};

function saveConversations() {
  storage.set(KEY.conversations, convs);
}
function saveInflight() {
  storage.set(KEY.inflight, inflight);
}

function newConversation() {
  const now = Date.now();
  /** @type {Conversation} */
  const c = { id: uid("c"), title: "New chat", createdAt: now, updatedAt: now, messages: [] };
  convs.items[c.id] = c;
  convs.order.unshift(c.id);
  return c;
}

function current() {
  return currentId ? convs.items[currentId] : null;
}

function findMessage(convId, msgId) {
  return convs.items[convId]?.messages.find((m) => m.id === msgId) ?? null;
}

// --- settings ----------------------------------------------------------------------------

const presets = (() => {
  try {
    return JSON.parse($("presets")?.textContent || "{}") ?? {};
  } catch {
    return {};
  }
})();
const settingsForm = /** @type {HTMLFormElement} */ ($("settings-form"));

function readSettingsForm() {
  /** @type {Record<string, any>} */
  const out = {};
  for (const el of settingsForm.elements) {
    const input = /** @type {HTMLInputElement} */ (el);
    if (!input.name) continue;
    if (NUMERIC.includes(input.name)) {
      const v = input.value.trim() === "" ? null : Number(input.value);
      out[input.name] = v === null || Number.isFinite(v) ? v : null;
    } else out[input.name] = input.value;
  }
  return out;
}

function initSettings() {
  const stored = storage.get(KEY.settings, {}) ?? {};
  for (const el of settingsForm.elements) {
    const input = /** @type {HTMLInputElement} */ (el);
    if (!input.name || input.name in presets) continue; // URL presets win (already rendered)
    const v = stored[input.name];
    input.value = v == null ? "" : String(v);
  }
  settingsForm.addEventListener("input", () => storage.set(KEY.settings, readSettingsForm()));
  settingsForm.addEventListener("submit", (e) => e.preventDefault());
}

/** The params of a generate frame from the settings (blank fields use the defaults). */
function generationParams() {
  const s = readSettingsForm();
  /** @type {Record<string, number>} */
  const params = {};
  const num = (name) => (s[name] ?? DEFAULT_SETTINGS[name]);
  params.temperature = Math.max(0, num("temperature"));
  params.max_tokens = Math.max(1, Math.round(num("max_tokens")));
  const topP = num("top_p");
  if (topP > 0 && topP <= 1) params.top_p = topP;
  const topK = num("top_k");
  if (topK > 0) params.top_k = Math.round(topK);
  if (s.seed != null) params.seed = Math.round(s.seed);
  return { params, system: (s.system ?? "").trim() };
}

// --- client ------------------------------------------------------------------------------

const API_KEY = "tokenrelay.apiKey"; // sessionStorage: asked once per tab, never in a URL
const fetchToken = wsTokenFetcher(() => sessionStorage.getItem(API_KEY));

/** A WebSocket token before every connect (null when the gateway has no API keys). */
async function wsToken() {
  try {
    return await fetchToken();
  } catch (err) {
    if (err?.code !== "unauthorized") throw err;
    const key = window.prompt("This gateway needs an API key:");
    if (!key) throw err;
    sessionStorage.setItem(API_KEY, key.trim());
    return fetchToken();
  }
}

const client = new TokenRelayClient({ token: wsToken });

/** The answer being streamed now (one at a time). */
/** @type {{stream: import("./tokenrelay-client.js").TokenRelayStream, record: Inflight}|null} */
let active = null;
/** The user message being edited (one at a time), with its unsaved text. */
/** @type {{convId: string, msgId: string, draft: string}|null} */
let editing = null;

// --- rendering ---------------------------------------------------------------------------

const messagesEl = $("messages");
const composer = /** @type {HTMLTextAreaElement} */ ($("composer"));
const sendBtn = /** @type {HTMLButtonElement} */ ($("send"));
const stopBtn = /** @type {HTMLButtonElement} */ ($("stop"));
const announcer = $("announcer");

/**
 * Say `text` once through the page's one live region (`#announcer`, polite). Answers are not
 * live regions themselves: streaming text would be read token by token.
 * @param {string} text
 */
function announce(text) {
  announcer.textContent = "";
  setTimeout(() => {
    announcer.textContent = text;
  }, 30);
}

/**
 * What the live region says when an answer ends: its text (as read, without Markdown marks;
 * cut after MAX_ANNOUNCED_CHARS), or that it was stopped or failed.
 * @param {Msg} m
 */
function answerAnnouncement(m) {
  const plain = (renderMarkdown(m.content).textContent ?? "").replace(/\s+/g, " ").trim();
  const text = plain.length > MAX_ANNOUNCED_CHARS ? `${plain.slice(0, MAX_ANNOUNCED_CHARS)}...` : plain;
  if (m.state === "error") return `The answer failed: ${m.error || "something went wrong"}.${text ? ` Partial answer: ${text}` : ""}`;
  if (m.state === "cancelled") return text ? `Answer stopped: ${text}` : "Answer stopped.";
  return `Answer: ${text || "(empty)"}`;
}

function nearBottom() {
  return messagesEl.scrollHeight - messagesEl.scrollTop - messagesEl.clientHeight < 80;
}
function scrollToBottom() {
  messagesEl.scrollTop = messagesEl.scrollHeight;
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
  const actions = document.createElement("div");
  actions.className = "actions";
  bubble.append(content);
  el.append(label, bubble);
  if (msg.role === "user") {
    const edit = document.createElement("button");
    edit.type = "button";
    edit.className = "btn btn-small";
    edit.dataset.testid = "edit";
    edit.textContent = "Edit";
    edit.setAttribute("aria-label", "Edit this message and answer it again");
    edit.addEventListener("click", () => startEditing(conv.id, msg.id));
    actions.append(edit);
    el.append(actions);
  } else {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "btn btn-small";
    copy.dataset.testid = "copy";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy this answer");
    copy.addEventListener("click", async () => {
      const m = findMessage(conv.id, msg.id);
      const ok = await copyText(m?.content ?? "");
      copy.textContent = ok ? "Copied" : "Copy failed";
      announce(ok ? "Answer copied" : "Could not copy");
      setTimeout(() => {
        copy.textContent = "Copy";
      }, 1500);
    });
    const regen = document.createElement("button");
    regen.type = "button";
    regen.className = "btn btn-small";
    regen.dataset.testid = "regenerate";
    regen.textContent = "Regenerate";
    regen.setAttribute("aria-label", "Regenerate this answer");
    regen.title = "Answer again from here (the messages after this answer are removed)";
    regen.addEventListener("click", () => regenerate(conv.id, msg.id));
    actions.append(copy, regen);
    bubble.append(meta, actions);
  }
  updateMessageElement(el, msg, conv);
  return el;
}

/** @param {HTMLElement} el @param {Msg} msg @param {Conversation} conv */
function updateMessageElement(el, msg, conv) {
  const state = msg.role === "user" ? "done" : (msg.state ?? "done");
  el.dataset.state = state;
  const content = /** @type {HTMLElement} */ (el.querySelector(".content"));
  if (msg.role === "user") {
    if (editing?.msgId === msg.id) showEditor(el, msg, conv);
    else {
      el.querySelector(".editor")?.remove();
      delete el.dataset.editing;
      content.hidden = false;
      content.textContent = msg.content; // never HTML
    }
  } else {
    content.setAttribute("aria-busy", state === "streaming" ? "true" : "false");
    content.replaceChildren(renderMarkdown(msg.content, MARKDOWN));
    if (state === "streaming") {
      const caret = document.createElement("span");
      caret.className = "caret";
      caret.setAttribute("aria-hidden", "true");
      (content.lastElementChild ?? content).append(caret);
    } else {
      decorateCodeBlocks(content, copyText);
    }
    if (state === "error") {
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
    regen.hidden = state === "streaming";
    const copy = /** @type {HTMLElement} */ (el.querySelector("[data-testid=copy]"));
    copy.hidden = state === "streaming";
  }
}

function renderMessages() {
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
function syncMessages(conv) {
  if (conv.id !== currentId) return;
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
function messageEl(msgId) {
  return /** @type {HTMLElement|null} */ (messagesEl.querySelector(`[data-id="${CSS.escape(msgId)}"]`));
}

/** Focus the message box (not on touch screens, where that opens the keyboard unasked). */
function focusComposer() {
  if (matchMedia("(pointer: coarse)").matches) messagesEl.focus({ preventScroll: true });
  else composer.focus();
}

// --- editing a user message --------------------------------------------------------------

/** @param {HTMLElement} el @param {Msg} msg @param {Conversation} conv */
function showEditor(el, msg, conv) {
  const content = /** @type {HTMLElement} */ (el.querySelector(".content"));
  content.hidden = true;
  el.dataset.editing = "true";
  if (el.querySelector(".editor")) return;
  const form = document.createElement("form");
  form.className = "editor";
  form.dataset.testid = "editor";
  const box = document.createElement("textarea");
  box.className = "editor-box";
  box.dataset.testid = "edit-box";
  box.rows = 3;
  box.setAttribute("aria-label", "Edit your message");
  box.value = editing?.draft ?? msg.content;
  box.addEventListener("input", () => {
    if (editing) editing.draft = box.value;
  });
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && !e.altKey && !e.ctrlKey && !e.metaKey) {
      e.preventDefault();
      form.requestSubmit();
    } else if (e.key === "Escape" && !e.shiftKey) {
      e.preventDefault();
      e.stopPropagation();
      cancelEditing();
    }
  });
  const bar = document.createElement("div");
  bar.className = "editor-actions";
  const save = document.createElement("button");
  save.type = "submit";
  save.className = "btn btn-primary btn-compact";
  save.dataset.testid = "edit-save";
  save.textContent = "Save and answer";
  save.title = "Replace this message and answer it again (the messages after it are removed)";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.className = "btn btn-compact";
  cancel.dataset.testid = "edit-cancel";
  cancel.textContent = "Cancel";
  cancel.addEventListener("click", () => cancelEditing());
  bar.append(save, cancel);
  form.append(box, bar);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    saveEdit(conv.id, msg.id, box.value);
  });
  content.after(form);
}

/** @param {string} convId @param {string} msgId */
function startEditing(convId, msgId) {
  if (active) return;
  const msg = findMessage(convId, msgId);
  if (!msg || msg.role !== "user") return;
  if (editing) cancelEditing(false);
  editing = { convId, msgId, draft: msg.content };
  const el = messageEl(msgId);
  if (!el) return;
  updateMessageElement(el, msg, convs.items[convId]);
  const box = /** @type {HTMLTextAreaElement|null} */ (el.querySelector("[data-testid=edit-box]"));
  box?.focus();
  box?.setSelectionRange(box.value.length, box.value.length);
}

/** Close the editor without saving. @param {boolean} [refocus] give focus back to its Edit button */
function cancelEditing(refocus = true) {
  const was = editing;
  editing = null;
  if (!was) return;
  const el = messageEl(was.msgId);
  const msg = findMessage(was.convId, was.msgId);
  if (!el || !msg) return;
  delete el.dataset.editing;
  updateMessageElement(el, msg, convs.items[was.convId]);
  if (refocus) /** @type {HTMLElement|null} */ (el.querySelector("[data-testid=edit]"))?.focus();
}

/**
 * Replace a user message and answer again from there: everything after it is removed.
 * @param {string} convId @param {string} msgId @param {string} text
 */
function saveEdit(convId, msgId, text) {
  const value = text.trim();
  if (!value || active || !client.workerReady) return; // held, like the composer
  const conv = convs.items[convId];
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

/** @param {string} text */
function titleOf(text) {
  return text.replace(/\s+/g, " ").slice(0, 60);
}

function renderConversationList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const id of convs.order) {
    const c = convs.items[id];
    if (!c) continue;
    const li = document.createElement("li");
    li.className = "conversation";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conversation-open";
    open.dataset.testid = "conversation";
    open.textContent = c.title || "New chat";
    if (id === currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      selectConversation(id);
      closeSidebar();
      composer.focus();
    });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "icon-btn conversation-delete";
    del.dataset.testid = "delete-conversation";
    del.setAttribute("aria-label", `Delete conversation: ${c.title || "New chat"}`);
    del.textContent = "\u00d7";
    del.addEventListener("click", () => deleteConversation(id));
    li.append(open, del);
    list.append(li);
  }
}

function selectConversation(id) {
  editing = null;
  currentId = id;
  storage.set(KEY.current, id);
  renderConversationList();
  renderMessages();
}

function deleteConversation(id) {
  if (active && active.record.convId === id) active.stream.cancel();
  delete convs.items[id];
  convs.order = convs.order.filter((x) => x !== id);
  for (const [k, r] of Object.entries(inflight)) if (r.convId === id) delete inflight[k];
  saveInflight();
  saveConversations();
  if (currentId === id) {
    currentId = convs.order[0] ?? null;
    storage.set(KEY.current, currentId);
  }
  renderConversationList();
  renderMessages();
}

// Streaming text is re-rendered at most once per frame.
const dirty = new Set();
let flushScheduled = false;
function scheduleRender(convId, msgId) {
  dirty.add(`${convId}\u0000${msgId}`);
  if (flushScheduled) return;
  flushScheduled = true;
  const flush = () => {
    if (!flushScheduled) return;
    flushScheduled = false;
    const stick = nearBottom();
    for (const key of dirty) {
      const [cId, mId] = key.split("\u0000");
      if (cId !== currentId) continue;
      const el = messagesEl.querySelector(`[data-id="${CSS.escape(mId)}"]`);
      const msg = findMessage(cId, mId);
      if (el && msg) updateMessageElement(/** @type {HTMLElement} */ (el), msg, convs.items[cId]);
    }
    dirty.clear();
    if (stick) scrollToBottom();
  };
  requestAnimationFrame(flush);
  setTimeout(flush, 100); // background tabs get no animation frames
}

function setBusy(busy) {
  sendBtn.hidden = busy;
  stopBtn.hidden = !busy;
  const app = $("app");
  app.dataset.busy = busy ? "true" : "false";
}

// --- generating --------------------------------------------------------------------------

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
  const stream = client.generate({ messages: history, params });
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
  inflight[msg.id] = record;
  saveInflight();
  follow(stream, record);
  syncMessages(conv);
  scrollToBottom();
}

/**
 * Wire a stream to its message: persist every token (so a reload resumes at the right seq),
 * render, and finish the message on done/error.
 * @param {import("./tokenrelay-client.js").TokenRelayStream} stream @param {Inflight} record
 */
function follow(stream, record) {
  active = { stream, record };
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
  delete inflight[record.msgId];
  saveInflight();
  const conv = convs.items[record.convId];
  if (conv) conv.updatedAt = Date.now();
  saveConversations();
  const hadFocus = document.activeElement === stopBtn;
  if (active?.record === record) active = null;
  setBusy(false);
  const m = findMessage(record.convId, record.msgId);
  // only this answer is re-rendered: the others stay as they are
  if (record.convId === currentId) {
    const el = messageEl(record.msgId);
    if (el && m && conv) updateMessageElement(el, m, conv);
  }
  announce(m ? answerAnnouncement(m) : announcement);
  if (hadFocus) composer.focus();
  updateDebug();
}

function send() {
  const text = composer.value.trim();
  if (!text || active || !client.workerReady) return; // held until a worker is ready
  let conv = current();
  if (!conv) {
    conv = newConversation();
    currentId = conv.id;
    storage.set(KEY.current, conv.id);
  }
  if (conv.messages.length === 0) conv.title = titleOf(text);
  conv.messages.push({ id: uid("m"), role: "user", content: text, createdAt: Date.now() });
  // move to the top of the list
  convs.order = [conv.id, ...convs.order.filter((x) => x !== conv.id)];
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
function regenerate(convId, msgId) {
  if (active || !client.workerReady) return;
  const conv = convs.items[convId];
  if (!conv) return;
  const idx = conv.messages.findIndex((m) => m.id === msgId);
  if (idx < 0 || conv.messages[idx].role !== "assistant") return;
  if (editing) cancelEditing(false);
  conv.messages.splice(idx);
  startAnswer(conv, historyFor(conv, conv.messages.length));
  focusComposer();
}

function stop() {
  if (active) active.stream.cancel();
}

/** After a reload: re-attach every answer that was streaming. */
function resumeInflight() {
  for (const record of Object.values(inflight)) {
    const m = findMessage(record.convId, record.msgId);
    if (!m) {
      delete inflight[record.msgId];
      continue;
    }
    if (!record.streamId || !record.resumeToken) {
      // the page went away before the server said `started`: nothing to resume
      m.state = "error";
      m.error = "The page was reloaded before the answer started.";
      delete inflight[record.msgId];
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

// --- connection indicator ----------------------------------------------------------------

const connEl = $("connection");
const connLabel = $("connection-label");
let resumedTimer = 0;

function showState(state) {
  // connected, but no engine worker ready yet: say so, and hold the send button
  const loading = state === "open" && !client.workerReady;
  connEl.dataset.state = loading ? "loading" : state;
  sendBtn.disabled = loading;
  if (state !== "open") {
    delete connEl.dataset.resumed;
    clearTimeout(resumedTimer);
  }
  if (state === "open" && connEl.dataset.resumed === "true") return;
  connLabel.textContent = loading ? "Loading model..." : (STATE_LABELS[state] ?? state);
}

// --- model and worker readiness -----------------------------------------------------------

const modelEl = $("model");
const modelName = $("model-name");
const workerState = $("worker-state");
let modelLoaded = false;

/** The served model's name from `GET /v1/models` (with the API key, on a gateway that has keys). */
async function loadModelName() {
  if (modelLoaded) return;
  const key = sessionStorage.getItem(API_KEY);
  try {
    const r = await fetch(new URL("/v1/models", location.origin), {
      headers: key ? { Authorization: `Bearer ${key}` } : {},
      credentials: "omit",
    });
    if (!r.ok) return; // tried again on the next connect
    const body = await r.json();
    const id = body?.data?.[0]?.id;
    if (typeof id !== "string" || !id) return;
    modelLoaded = true;
    modelName.textContent = id;
    showReadiness();
  } catch {
    /* offline or refused: tried again on the next connect */
  }
}

/** The header's worker readiness: ready, loading (connected, no worker yet) or unknown. */
function showReadiness() {
  const open = client.state === "open";
  const ready = open ? (client.workerReady ? "true" : "false") : "unknown";
  modelEl.dataset.ready = ready;
  workerState.textContent =
    ready === "true" ? "ready" : ready === "false" ? "loading" : "not connected";
  modelEl.title = `Model: ${modelLoaded ? modelName.textContent : "unknown"}, worker: ${workerState.textContent}`;
}

function flashResumed() {
  connEl.dataset.resumed = "true";
  connLabel.textContent = "Resumed";
  clearTimeout(resumedTimer);
  resumedTimer = setTimeout(() => {
    delete connEl.dataset.resumed;
    connLabel.textContent = STATE_LABELS[client.state] ?? client.state;
  }, 4000);
}

client.addEventListener("state", (e) => {
  showState(e.detail.state);
  showReadiness();
  updateDebug();
});
client.addEventListener("readiness", () => {
  showState(client.state);
  showReadiness();
});
client.addEventListener("open", () => {
  showReadiness();
  loadModelName();
});

// --- debug panel -------------------------------------------------------------------------

const debugEl = $("debug");
function setDebug(testid, value) {
  const el = debugEl?.querySelector(`[data-testid=${testid}]`);
  if (el) el.textContent = String(value);
}
function updateDebug() {
  if (!debugEl) return;
  setDebug("debug-socket", client.state);
  setDebug("debug-stream-id", active?.stream.streamId ?? active?.record.streamId ?? "-");
  setDebug("debug-last-seq", active?.stream.lastSeq ?? 0);
  setDebug("debug-resumes", client.stats.resumes);
  setDebug("debug-reconnects", client.stats.reconnects);
  setDebug("debug-duplicates", client.stats.duplicates);
  setDebug("debug-endpoint", client.url);
}

// --- layout: sidebar, settings, composer -------------------------------------------------

const sidebar = $("sidebar");
const scrim = $("scrim");
const toggleSidebarBtn = $("toggle-sidebar");
function openSidebar() {
  sidebar.dataset.open = "true";
  scrim.hidden = false;
  toggleSidebarBtn.setAttribute("aria-expanded", "true");
  /** @type {HTMLElement|null} */ (sidebar.querySelector("button"))?.focus();
}
function closeSidebar() {
  if (sidebar.dataset.open !== "true") return;
  sidebar.dataset.open = "false";
  scrim.hidden = true;
  toggleSidebarBtn.setAttribute("aria-expanded", "false");
}

function newChat() {
  const conv = current();
  if (!conv || conv.messages.length > 0) {
    const c = newConversation();
    saveConversations();
    selectConversation(c.id);
  }
  closeSidebar();
  composer.focus();
}

/** @param {EventTarget|null} target */
function isTextField(target) {
  const el = /** @type {HTMLElement|null} */ (target);
  if (!el || !el.tagName) return false;
  return el.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(el.tagName);
}

/**
 * Page-wide keys (listed under the composer and in docs/client.md): Esc stops the answer (or
 * closes the conversation list), Shift+Esc or / (outside a text field) focuses the message
 * box, Ctrl+Shift+O (Cmd+Shift+O on a Mac) starts a new chat.
 * @param {KeyboardEvent} e
 */
function onShortcut(e) {
  if (e.defaultPrevented || e.isComposing) return;
  const mod = e.ctrlKey || e.metaKey;
  if (mod && e.shiftKey && !e.altKey && e.code === "KeyO") {
    e.preventDefault();
    newChat();
  } else if (e.key === "Escape" && e.shiftKey && !mod && !e.altKey) {
    e.preventDefault();
    closeSidebar();
    composer.focus();
  } else if (e.key === "/" && !mod && !e.altKey && !isTextField(e.target)) {
    e.preventDefault();
    closeSidebar();
    composer.focus();
  } else if (e.key === "Escape" && !mod && !e.altKey) {
    if (active) {
      e.preventDefault();
      stop();
    } else if (sidebar.dataset.open === "true") {
      closeSidebar();
      toggleSidebarBtn.focus();
    }
  }
}

/** Show the platform's modifier key name in the shortcut hints (Cmd on a Mac). */
function labelShortcuts() {
  const mac = /Mac|iPhone|iPad/.test(navigator.platform || navigator.userAgent);
  for (const k of document.querySelectorAll("[data-key=mod]")) k.textContent = mac ? "Cmd" : "Ctrl";
}

function autosize() {
  composer.style.height = "auto";
  composer.style.height = `${Math.min(composer.scrollHeight, 220)}px`;
}

function bindUi() {
  $("composer-form").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  composer.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && !e.altKey && !e.ctrlKey && !e.metaKey) {
      e.preventDefault();
      send();
    }
  });
  composer.addEventListener("input", autosize);
  stopBtn.addEventListener("click", stop);
  document.addEventListener("keydown", onShortcut);
  $("new-chat").addEventListener("click", newChat);
  toggleSidebarBtn.addEventListener("click", () =>
    sidebar.dataset.open === "true" ? closeSidebar() : openSidebar(),
  );
  scrim.addEventListener("click", closeSidebar);
  const settingsBtn = $("toggle-settings");
  settingsBtn.addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    settingsBtn.setAttribute("aria-expanded", String(!panel.hidden));
    if (!panel.hidden) /** @type {HTMLElement|null} */ (panel.querySelector("input"))?.focus();
  });
  $("drop-connection")?.addEventListener("click", () => {
    client.dropConnection();
    updateDebug();
  });
  // another tab changed the conversations: pick up the list (not the open stream)
  window.addEventListener("storage", (e) => {
    if (e.key !== KEY.conversations || active) return;
    convs = storage.get(KEY.conversations, convs);
    if (currentId && !convs.items[currentId]) currentId = convs.order[0] ?? null;
    renderConversationList();
    renderMessages();
  });
}

// --- start -------------------------------------------------------------------------------

initSettings();
bindUi();
labelShortcuts();
if (!currentId && convs.order.length) currentId = convs.order[0];
resumeInflight();
renderConversationList();
renderMessages();
setBusy(active !== null);
showState(client.state);
showReadiness();
client.connect();
updateDebug();
if (!matchMedia("(pointer: coarse)").matches) composer.focus();

/** Devtools / QA handle: `tokenrelay.client.dropConnection()`, `tokenrelay.active`... */
Object.defineProperty(window, "tokenrelay", {
  configurable: true,
  value: Object.freeze({
    client,
    TokenRelayClient,
    get active() {
      return active ? { stream: active.stream, ...active.record } : null;
    },
    get conversations() {
      return convs;
    },
    settings: () => generationParams(),
    send: (/** @type {string} */ text) => {
      composer.value = text;
      send();
    },
    stop,
  }),
});
