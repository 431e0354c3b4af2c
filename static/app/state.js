// The chat page's state (static/app.js): the conversations, the current one and the answers in
// flight, kept in localStorage (the in-flight stream's id, resume token, last seq and text are
// saved per token, so a reload resumes it), and, for this tab only, the answer streaming now
// and the user message being edited. No DOM here.

export const KEY = {
  conversations: "tokenrelay.v1.conversations",
  current: "tokenrelay.v1.current",
  settings: "tokenrelay.v1.settings",
  inflight: "tokenrelay.v1.inflight",
};

/** localStorage as JSON; a full or disabled storage only loses persistence. */
export const storage = {
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

export function uid(prefix) {
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
 * @typedef {{order: string[], items: Record<string, Conversation>}} Conversations
 */

/** @returns {Conversations} */
function loadConversations() {
  const convs = storage.get(KEY.conversations, { order: [], items: {} });
  if (!convs || !Array.isArray(convs.order) || typeof convs.items !== "object") {
    return { order: [], items: {} };
  }
  return convs;
}

const convs = loadConversations();
/** @type {string|null} */
let currentId = storage.get(KEY.current, null);
if (currentId && !convs.items[currentId]) currentId = null;

/**
 * Everything the page's modules share. `convs`, `currentId` and `inflight` are saved with
 * saveConversations(), storage.set(KEY.current, ...) and saveInflight(); `active` (the answer
 * being streamed now, one at a time) and `editing` (the user message being edited, one at a
 * time, with its unsaved text) are not.
 * @type {{convs: Conversations, currentId: string|null, inflight: Record<string, Inflight>,
 *   active: {stream: import("../tokenrelay-client.js").TokenRelayStream, record: Inflight}|null,
 *   editing: {convId: string, msgId: string, draft: string}|null}}
 */
export const state = {
  convs,
  currentId,
  inflight: storage.get(KEY.inflight, {}) ?? {},
  active: null,
  editing: null,
};

export function saveConversations() {
  storage.set(KEY.conversations, state.convs);
}
export function saveInflight() {
  storage.set(KEY.inflight, state.inflight);
}

/** Another tab changed the conversations: take its list (the current one stays if it is kept). */
export function reloadConversations() {
  state.convs = storage.get(KEY.conversations, state.convs);
  if (state.currentId && !state.convs.items[state.currentId]) {
    state.currentId = state.convs.order[0] ?? null;
  }
}

export function newConversation() {
  const now = Date.now();
  /** @type {Conversation} */
  const c = { id: uid("c"), title: "New chat", createdAt: now, updatedAt: now, messages: [] };
  state.convs.items[c.id] = c;
  state.convs.order.unshift(c.id);
  return c;
}

export function current() {
  return state.currentId ? state.convs.items[state.currentId] : null;
}

/** @param {string} convId @param {string} msgId @returns {Msg|null} */
export function findMessage(convId, msgId) {
  return state.convs.items[convId]?.messages.find((m) => m.id === msgId) ?? null;
}

/** A conversation's title from its first message. @param {string} text */
export function titleOf(text) {
  return text.replace(/\s+/g, " ").slice(0, 60);
}
