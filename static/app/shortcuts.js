// The chat page's keyboard (listed under the message box and in docs/client.md): Enter sends
// and Shift+Enter adds a line in the message box; page-wide, Esc stops the answer (or closes
// the conversation list), Shift+Esc or / (outside a text field) focuses the message box, and
// Ctrl+Shift+O (Cmd+Shift+O on a Mac) starts a new chat.

import { send, stop } from "./answers.js";
import { composer } from "./dom.js";
import { closeSidebar, dismissSidebar, newChat, sidebarOpen } from "./sidebar.js";
import { state } from "./state.js";

/** @param {EventTarget|null} target */
function isTextField(target) {
  const el = /** @type {HTMLElement|null} */ (target);
  if (!el || !el.tagName) return false;
  return el.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(el.tagName);
}

/** The message box: Enter sends, Shift+Enter adds a line. @param {KeyboardEvent} e */
export function onComposerKey(e) {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing && !e.altKey && !e.ctrlKey && !e.metaKey) {
    e.preventDefault();
    send();
  }
}

/**
 * Page-wide keys: Esc stops the answer (or closes the conversation list), Shift+Esc or /
 * (outside a text field) focuses the message box, Ctrl+Shift+O (Cmd+Shift+O on a Mac) starts
 * a new chat.
 * @param {KeyboardEvent} e
 */
export function onShortcut(e) {
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
    if (state.active) {
      e.preventDefault();
      stop();
    } else if (sidebarOpen()) {
      dismissSidebar();
    }
  }
}

/** Show the platform's modifier key name in the shortcut hints (Cmd on a Mac). */
export function labelShortcuts() {
  const mac = /Mac|iPhone|iPad/.test(navigator.platform || navigator.userAgent);
  for (const k of document.querySelectorAll("[data-key=mod]")) k.textContent = mac ? "Cmd" : "Ctrl";
}
