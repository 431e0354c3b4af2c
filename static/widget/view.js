// The <tokenrelay-chat> widget's markup (widget.js loads this module): the launcher bubble,
// the panel (header with the connection state, the alert line, the messages, the message
// box) and one message. DOM only: what the parts do is the element's (widget/element.js).
// Its texts come from the widget's table (widget/api.js, translatable: `t` below). Nodes are
// built with the DOM, never from an HTML string, so the widget runs under Trusted Types.
// User and model text is only ever set as text, or as sanitised Markdown (markdown.js).

const SVG = "http://www.w3.org/2000/svg";

/** The launcher's chat-bubble icon, built as DOM nodes (no markup string: Trusted Types). */
function chatIcon() {
  const svg = document.createElementNS(SVG, "svg");
  const attrs = {
    viewBox: "0 0 24 24",
    fill: "none",
    stroke: "currentColor",
    "stroke-width": "2",
    "stroke-linecap": "round",
    "stroke-linejoin": "round",
    "aria-hidden": "true",
  };
  for (const [k, v] of Object.entries(attrs)) svg.setAttribute(k, v);
  const path = document.createElementNS(SVG, "path");
  path.setAttribute("d", "M21 15a2 2 0 0 1-2 2H7l-4 4V5a2 2 0 0 1 2-2h14a2 2 0 0 1 2 2z");
  svg.append(path);
  return svg;
}

/**
 * A text of the widget's table (widget/api.js STRINGS, translated or not), `{name}`s filled.
 * @typedef {(key: string, values?: Record<string, string|number>) => string} Text
 */

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
 * The launcher and the panel (closed), with the parts the element works with; their texts
 * come from applyTexts().
 */
export function buildView() {
  const launcher = el(
    "button",
    {
      type: "button",
      class: "launcher",
      part: "launcher",
      "aria-expanded": "false",
      "aria-controls": "panel",
      "data-testid": "widget-launcher",
    },
    chatIcon(),
  );
  const title = el("span", { class: "title" });
  const connLabel = el("span", { class: "label" });
  const conn = el(
    "span",
    { class: "conn", "data-testid": "connection", "data-state": "idle", role: "status" },
    el("span", { class: "dot", "aria-hidden": "true" }),
    connLabel,
  );
  const close = el("button", { type: "button", class: "close", "data-testid": "widget-close", text: "\u00d7" });
  const alert = el("p", { class: "alert", role: "alert", "data-testid": "widget-error", hidden: true });
  const list = el("div", { class: "messages", "data-testid": "messages" });
  const empty = el("p", { class: "empty" });
  list.append(empty);
  const input = el("textarea", { id: "input", rows: "1", "data-testid": "composer", enterkeyhint: "send" });
  const send = el("button", { type: "submit", "data-testid": "send" });
  const stop = el("button", { type: "button", class: "stop", "data-testid": "stop", hidden: true });
  const inputLabel = el("label", { for: "input", class: "vh" });
  const form = el("form", { class: "composer" }, inputLabel, input, send, stop);
  const foot = el("div", { class: "foot" });
  const panel = el(
    "section",
    { id: "panel", class: "panel", part: "panel", role: "dialog", "data-testid": "widget-panel", hidden: true },
    el("header", { part: "header" }, title, conn, close),
    alert,
    list,
    form,
    foot,
  );
  return { launcher, title, connLabel, conn, close, alert, list, empty, input, inputLabel, send, stop, form, foot, panel };
}

/**
 * Put the texts on the parts buildView() made (again after any of them changes).
 * @param {ReturnType<typeof buildView>} v
 * @param {Text} t
 * @param {{title: string, greeting: string, placeholder: string}} texts the attributes' or
 *   the table's
 */
export function applyTexts(v, t, texts) {
  v.launcher.setAttribute("aria-label", t("openChat", { title: texts.title }));
  v.panel.setAttribute("aria-label", texts.title);
  v.title.textContent = texts.title;
  v.close.setAttribute("aria-label", t("closeChat"));
  v.list.setAttribute("aria-label", t("messages"));
  v.empty.textContent = texts.greeting;
  v.input.placeholder = texts.placeholder;
  v.inputLabel.textContent = t("messageLabel");
  v.send.textContent = t("send");
  v.stop.textContent = t("stop");
  v.foot.textContent = t("poweredBy");
}

/**
 * The calls of an answer as the widget shows them: a line per call ("Calling {name}..."
 * while the answer streams, then "Called {name}") and its arguments, as far as they came.
 * @param {{state?: string, toolCalls?: {function: {name: string, arguments: string}}[]}} m
 * @param {Text} t
 * @returns {{label: string, args: string}[]}
 */
export function toolCallLines(m, t) {
  const key = m.state === "streaming" ? "callingTool" : "calledTool";
  return (m.toolCalls ?? []).map((c) => ({
    label: t(key, { name: c.function.name }),
    args: c.function.arguments,
  }));
}

/**
 * One message: a user's as text, an answer as Markdown then its calls (toolCallLines), with
 * a note when it was stopped or failed: its error, else "did not finish".
 * @param {{role: string, content: string, state?: string, note?: string,
 *   toolCalls?: {function: {name: string, arguments: string}}[],
 *   error?: {code: string, message: string}}} m
 * @param {(text: string) => Node} renderMarkdown
 * @param {Text} t
 */
export function messageNode(m, renderMarkdown, t) {
  const body = el("div", { class: "body", "data-testid": "message-content" });
  const node = el(
    "div",
    { class: "msg", "data-testid": "message", "data-role": m.role, "data-state": m.role === "user" ? "done" : (m.state || "done") },
    el("span", { class: "vh", text: t(m.role === "user" ? "youSaid" : "answer") }),
    body,
  );
  if (m.role === "user") body.textContent = m.content;
  else {
    body.setAttribute("aria-live", "polite");
    body.setAttribute("aria-busy", m.state === "streaming" ? "true" : "false");
    body.append(renderMarkdown(m.content));
    for (const { label, args } of toolCallLines(m, t)) {
      const code = el("code", { text: args, hidden: !args });
      body.append(el("p", { class: "tool-call", "data-testid": "tool-call" }, el("span", { text: label }), code));
    }
    let note = null;
    if (m.state === "cancelled") note = t("stopped");
    else if (m.state === "error") note = m.error ? t("answerError", m.error) : (m.note || t("unfinished"));
    if (note) body.append(el("p", { class: "note", text: note }));
  }
  return node;
}
