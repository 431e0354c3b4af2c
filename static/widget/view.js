// The <tokenrelay-chat> widget's markup (widget.js loads this module): the launcher bubble,
// the panel (header with the connection state, the alert line, the messages, the message
// box) and one message. DOM only: what the parts do is the element's (widget/element.js).
// User and model text is only ever set as text, or as sanitised Markdown (markdown.js).

/** What the connection indicator says in each client state. */
export const LABELS = {
  idle: "Offline",
  connecting: "Connecting...",
  open: "Online",
  reconnecting: "Reconnecting...",
  offline: "Offline",
  closed: "Disconnected",
};

const CHAT_ICON =
  '<svg viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2" stroke-linecap="round" stroke-linejoin="round" aria-hidden="true"><path d="M21 15a2 2 0 0 1-2 2H7l-4 4V5a2 2 0 0 1 2-2h14a2 2 0 0 1 2 2z"/></svg>';

/**
 * An element with attributes (`text`: its text; false or null: left out; true: empty) and
 * children.
 * @param {string} tag @param {Record<string, any>} [attrs] @param {...Node} children
 */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === false || v == null) continue;
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  node.append(...children);
  return node;
}

/**
 * The launcher and the panel (closed), with the parts the element works with.
 * @param {{title: string, greeting: string, placeholder: string}} texts
 */
export function buildView(texts) {
  const title = texts.title;
  const launcher = el("button", {
    type: "button",
    class: "launcher",
    part: "launcher",
    "aria-expanded": "false",
    "aria-controls": "panel",
    "aria-label": `Open chat: ${title}`,
    "data-testid": "widget-launcher",
  });
  launcher.innerHTML = CHAT_ICON; // constant markup, no user data
  const titleEl = el("span", { class: "title", text: title });
  const connLabel = el("span", { class: "label", text: "Offline" });
  const conn = el(
    "span",
    { class: "conn", "data-testid": "connection", "data-state": "idle", role: "status" },
    el("span", { class: "dot", "aria-hidden": "true" }),
    connLabel,
  );
  const close = el("button", {
    type: "button",
    class: "close",
    "aria-label": "Close chat",
    "data-testid": "widget-close",
    text: "\u00d7",
  });
  const alert = el("p", { class: "alert", role: "alert", "data-testid": "widget-error", hidden: true });
  const list = el("div", { class: "messages", "data-testid": "messages", "aria-label": "Messages" });
  const empty = el("p", { class: "empty", text: texts.greeting });
  list.append(empty);
  const input = el("textarea", {
    id: "input",
    rows: "1",
    "data-testid": "composer",
    placeholder: texts.placeholder,
    enterkeyhint: "send",
  });
  const send = el("button", { type: "submit", "data-testid": "send", text: "Send" });
  const stop = el("button", { type: "button", class: "stop", "data-testid": "stop", text: "Stop", hidden: true });
  const form = el(
    "form",
    { class: "composer" },
    el("label", { for: "input", class: "vh", text: "Message" }),
    input,
    send,
    stop,
  );
  const panel = el(
    "section",
    { id: "panel", class: "panel", part: "panel", role: "dialog", "aria-label": title, "data-testid": "widget-panel", hidden: true },
    el("header", { part: "header" }, titleEl, conn, close),
    alert,
    list,
    form,
    el("div", { class: "foot", text: "Powered by tokenrelay" }),
  );
  return { launcher, title: titleEl, connLabel, conn, close, alert, list, empty, input, send, stop, form, panel };
}

/**
 * One message: a user's as text, an answer as Markdown (with its note when it was stopped or
 * failed).
 * @param {{role: string, content: string, state?: string, note?: string}} m
 * @param {(text: string) => Node} renderMarkdown
 */
export function messageNode(m, renderMarkdown) {
  const body = el("div", { class: "body", "data-testid": "message-content" });
  const node = el(
    "div",
    { class: "msg", "data-testid": "message", "data-role": m.role, "data-state": m.role === "user" ? "done" : (m.state || "done") },
    el("span", { class: "vh", text: m.role === "user" ? "You said:" : "Answer:" }),
    body,
  );
  if (m.role === "user") body.textContent = m.content;
  else {
    body.setAttribute("aria-live", "polite");
    body.setAttribute("aria-busy", m.state === "streaming" ? "true" : "false");
    body.append(renderMarkdown(m.content));
    if (m.note) body.append(el("p", { class: "note", text: m.note }));
  }
  return node;
}
