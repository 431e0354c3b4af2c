// The chat page's shared elements (web/templates/index.html) and the small things several
// modules do with them: the one live region, scrolling the message list, the message box's
// focus and height, and the busy state (Stop shown instead of Send).

export const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));

export const messagesEl = $("messages");
export const composer = /** @type {HTMLTextAreaElement} */ ($("composer"));
export const sendBtn = /** @type {HTMLButtonElement} */ ($("send"));
export const stopBtn = /** @type {HTMLButtonElement} */ ($("stop"));
const announcer = $("announcer");

/**
 * Say `text` once through the page's one live region (`#announcer`, polite). Answers are not
 * live regions themselves: streaming text would be read token by token.
 * @param {string} text
 */
/**
 * A button: `type` "button" unless given, its class, test id, text and, where set, its
 * aria-label, title and click handler.
 * @param {{className: string, testid: string, text: string, label?: string, title?: string,
 *   type?: "button"|"submit", onClick?: (e: MouseEvent) => unknown}} spec
 */
export function button({ className, testid, text, label, title, type = "button", onClick }) {
  const b = document.createElement("button");
  b.type = type;
  b.className = className;
  b.dataset.testid = testid;
  b.textContent = text;
  if (label) b.setAttribute("aria-label", label);
  if (title) b.title = title;
  if (onClick) b.addEventListener("click", onClick);
  return b;
}

export function announce(text) {
  announcer.textContent = "";
  setTimeout(() => {
    announcer.textContent = text;
  }, 30);
}

export function nearBottom() {
  return messagesEl.scrollHeight - messagesEl.scrollTop - messagesEl.clientHeight < 80;
}
export function scrollToBottom() {
  messagesEl.scrollTop = messagesEl.scrollHeight;
}

/** Focus the message box (not on touch screens, where that opens the keyboard unasked). */
export function focusComposer() {
  if (matchMedia("(pointer: coarse)").matches) messagesEl.focus({ preventScroll: true });
  else composer.focus();
}

/** Grow the message box with its text (up to 220 px). */
export function autosize() {
  composer.style.height = "auto";
  composer.style.height = `${Math.min(composer.scrollHeight, 220)}px`;
}

/** @param {boolean} busy an answer streams: Stop instead of Send */
export function setBusy(busy) {
  sendBtn.hidden = busy;
  stopBtn.hidden = !busy;
  const app = $("app");
  app.dataset.busy = busy ? "true" : "false";
}
