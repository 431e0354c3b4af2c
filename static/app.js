// The chat page at `/` (web/templates/index.html loads this module): conversations in
// localStorage, streaming Markdown answers (with syntax-highlighted code) over
// TokenRelayClient, Stop / edit / regenerate / copy, the model and a connection indicator in
// the header, keyboard shortcuts, one live region that reads each finished answer, and resume
// after a reload. This module wires the page together and starts it; the parts are in app/:
//   state.js        conversations, in-flight answers (localStorage), the active answer
//   connection.js   the page's TokenRelayClient and its WebSocket token
//   settings.js     the generation settings form and URL presets
//   dom.js          shared elements: live region, scrolling, message box, busy state
//   messages.js     the message list (editor.js: editing a user message in place)
//   answers.js      send, regenerate, save an edit, stream, stop, resume after a reload
//   sidebar.js      the conversation list and its drawer
//   status.js       connection indicator, model and worker readiness, debug panel
//   shortcuts.js    the keyboard
// QA hooks (docs/client.md): `?debug=1`, `window.tokenrelay`, stable data-testid selectors.
import { TokenRelayClient } from "./tokenrelay-client.js";
import { regenerate, resumeInflight, saveEdit, send, stop } from "./app/answers.js";
import { client } from "./app/connection.js";
import { $, autosize, composer, setBusy, stopBtn } from "./app/dom.js";
import { renderMessages, setMessageActions } from "./app/messages.js";
import { generationParams, initSettings, toggleSettings } from "./app/settings.js";
import { labelShortcuts, onComposerKey, onShortcut } from "./app/shortcuts.js";
import { bindSidebar, renderConversationList } from "./app/sidebar.js";
import { KEY, reloadConversations, state } from "./app/state.js";
import { bindStatus, showReadiness, showState, updateDebug } from "./app/status.js";

function bindUi() {
  $("composer-form").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  composer.addEventListener("keydown", onComposerKey);
  composer.addEventListener("input", autosize);
  stopBtn.addEventListener("click", stop);
  document.addEventListener("keydown", onShortcut);
  bindSidebar();
  $("toggle-settings").addEventListener("click", toggleSettings);
  $("drop-connection")?.addEventListener("click", () => {
    client.dropConnection();
    updateDebug();
  });
  // another tab changed the conversations: pick up the list (not the open stream)
  window.addEventListener("storage", (e) => {
    if (e.key !== KEY.conversations || state.active) return;
    reloadConversations();
    renderConversationList();
    renderMessages();
  });
}

// --- start -------------------------------------------------------------------------------

bindStatus();
setMessageActions({ regenerate, saveEdit });
initSettings();
bindUi();
labelShortcuts();
if (!state.currentId && state.convs.order.length) state.currentId = state.convs.order[0];
resumeInflight();
renderConversationList();
renderMessages();
setBusy(state.active !== null);
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
      return state.active ? { stream: state.active.stream, ...state.active.record } : null;
    },
    get conversations() {
      return state.convs;
    },
    settings: () => generationParams(),
    send: (/** @type {string} */ text) => {
      composer.value = text;
      send();
    },
    stop,
  }),
});
