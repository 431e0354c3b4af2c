// The chat page's conversation list: New chat, open or delete a conversation, and on a phone
// the drawer it lives in (opened by the menu button, closed by the scrim or Esc).

import { $, button, composer } from "./dom.js";
import { renderMessages } from "./messages.js";
import {
  current,
  KEY,
  newConversation,
  saveConversations,
  saveInflight,
  state,
  storage,
} from "./state.js";

const sidebar = $("sidebar");
const scrim = $("scrim");
const toggleSidebarBtn = $("toggle-sidebar");

export function renderConversationList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const id of state.convs.order) {
    const c = state.convs.items[id];
    if (!c) continue;
    const li = document.createElement("li");
    li.className = "conversation";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conversation-open";
    open.dataset.testid = "conversation";
    open.textContent = c.title || "New chat";
    if (id === state.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      selectConversation(id);
      closeSidebar();
      composer.focus();
    });
    const del = button({
      className: "icon-btn conversation-delete",
      testid: "delete-conversation",
      text: "\u00d7",
      label: `Delete conversation: ${c.title || "New chat"}`,
      onClick: () => deleteConversation(id),
    });
    li.append(open, del);
    list.append(li);
  }
}

/** @param {string} id */
function selectConversation(id) {
  state.editing = null;
  state.currentId = id;
  storage.set(KEY.current, id);
  renderConversationList();
  renderMessages();
}

/** @param {string} id */
function deleteConversation(id) {
  if (state.active && state.active.record.convId === id) state.active.stream.cancel();
  delete state.convs.items[id];
  state.convs.order = state.convs.order.filter((x) => x !== id);
  for (const [k, r] of Object.entries(state.inflight)) if (r.convId === id) delete state.inflight[k];
  saveInflight();
  saveConversations();
  if (state.currentId === id) {
    state.currentId = state.convs.order[0] ?? null;
    storage.set(KEY.current, state.currentId);
  }
  renderConversationList();
  renderMessages();
}

/** Start a new conversation (the empty current one is reused) and go to the message box. */
export function newChat() {
  const conv = current();
  if (!conv || conv.messages.length > 0) {
    const c = newConversation();
    saveConversations();
    selectConversation(c.id);
  }
  closeSidebar();
  composer.focus();
}

// --- the drawer (phone-sized screens) ----------------------------------------------------

export function sidebarOpen() {
  return sidebar.dataset.open === "true";
}

export function openSidebar() {
  sidebar.dataset.open = "true";
  scrim.hidden = false;
  toggleSidebarBtn.setAttribute("aria-expanded", "true");
  /** @type {HTMLElement|null} */ (sidebar.querySelector("button"))?.focus();
}

export function closeSidebar() {
  if (sidebar.dataset.open !== "true") return;
  sidebar.dataset.open = "false";
  scrim.hidden = true;
  toggleSidebarBtn.setAttribute("aria-expanded", "false");
}

/** The menu button: open or close the drawer. */
export function toggleSidebar() {
  if (sidebarOpen()) closeSidebar();
  else openSidebar();
}

/** Esc: close the drawer and give focus back to the menu button. */
export function dismissSidebar() {
  closeSidebar();
  toggleSidebarBtn.focus();
}

export function bindSidebar() {
  $("new-chat").addEventListener("click", newChat);
  toggleSidebarBtn.addEventListener("click", toggleSidebar);
  scrim.addEventListener("click", closeSidebar);
}
