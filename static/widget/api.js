// The <tokenrelay-chat> widget's public contract (widget.js loads this module, and the npm
// package exports it as `tokenrelay-client/widget`, typed by static/widget.d.ts): the
// element's attribute names, the table of every text it shows with its English defaults,
// and the details of its events. No DOM and no imports: it runs anywhere.
// docs/client.md, "Widget" and "Translating the widget".

/** Every attribute of <tokenrelay-chat> (each one may change at any time; docs/client.md). */
export const ATTRIBUTES = Object.freeze(
  /** @type {const} */ ([
    "endpoint",
    "token-url",
    "chat-title",
    "open",
    "inline",
    "position",
    "theme",
    "greeting",
    "placeholder",
    "system",
    "temperature",
    "max-tokens",
    "seed",
    "model",
    "strings",
  ]),
);

/**
 * @typedef {typeof ATTRIBUTES[number]} TokenRelayChatAttribute
 * @typedef {{[K in TokenRelayChatAttribute]?: string}} TokenRelayChatAttributes
 *   the attributes as a framework's template sets them (`open` and `inline`: present or not)
 */

/**
 * Every text the widget shows or gives assistive technology, in English. `{name}` is filled
 * in: `{title}` with the chat's title, `{message}` and `{code}` with an error's (those come
 * from the gateway or the browser and are not translated), `{name}` with a called tool's.
 * @typedef {{title: string, greeting: string, placeholder: string, openChat: string,
 *   closeChat: string, messages: string, messageLabel: string, send: string, stop: string,
 *   poweredBy: string, youSaid: string, answer: string, stopped: string, unfinished: string,
 *   answerError: string, retrying: string, tokenFailed: string, stateIdle: string,
 *   stateConnecting: string, stateOpen: string, stateReconnecting: string,
 *   stateOffline: string, stateClosed: string, stateLoading: string,
 *   stateResumed: string, callingTool: string, calledTool: string}} WidgetStrings
 */

/** @type {Readonly<WidgetStrings>} */
export const STRINGS = Object.freeze({
  title: "Chat",
  greeting: "Ask a question. Enter sends, Shift+Enter adds a line.",
  placeholder: "Type a message...",
  openChat: "Open chat: {title}",
  closeChat: "Close chat",
  messages: "Messages",
  messageLabel: "Message",
  send: "Send",
  stop: "Stop",
  poweredBy: "Powered by tokenrelay",
  youSaid: "You said:",
  answer: "Answer:",
  stopped: "Stopped",
  unfinished: "The answer did not finish.",
  answerError: "{message} ({code})",
  retrying: "{message}. Retrying...",
  tokenFailed: "Could not get a chat token: {message}",
  stateIdle: "Offline",
  stateConnecting: "Connecting...",
  stateOpen: "Online",
  stateReconnecting: "Reconnecting...",
  stateOffline: "Offline",
  stateClosed: "Disconnected",
  stateLoading: "Loading model...",
  stateResumed: "Resumed",
  callingTool: "Calling {name}...",
  calledTool: "Called {name}",
});

/**
 * The English table with `overrides` laid over it in order (later ones win). Only the keys
 * of STRINGS with string values are taken; anything else is ignored.
 * @param {...(Partial<WidgetStrings>|Record<string, unknown>|null|undefined)} overrides
 * @returns {Readonly<WidgetStrings>}
 */
export function resolveStrings(...overrides) {
  /** @type {Record<string, string>} */
  const out = { ...STRINGS };
  for (const o of overrides) {
    if (!o || typeof o !== "object") continue;
    for (const key of Object.keys(STRINGS)) {
      const value = /** @type {Record<string, unknown>} */ (o)[key];
      if (typeof value === "string") out[key] = value;
    }
  }
  return Object.freeze(/** @type {WidgetStrings} */ (/** @type {unknown} */ (out)));
}

/**
 * `template` with each `{name}` replaced by `values[name]` (unknown names stay as written).
 * @param {string} template
 * @param {Record<string, string|number>} [values]
 * @returns {string}
 */
export function formatString(template, values = {}) {
  return String(template).replace(/\{(\w+)\}/g, (whole, name) =>
    Object.prototype.hasOwnProperty.call(values, name) ? String(values[name]) : whole,
  );
}

/**
 * The details of the widget's events (CustomEvents that bubble out of its shadow root).
 * @typedef {{text: string}} SendDetail
 *   `tokenrelay:send`: the visitor sent a message
 * @typedef {{text: string, state: "done"|"cancelled"|"error",
 *   toolCalls?: {id: string, type: "function", function: {name: string, arguments: string}}[]}}
 *   DoneDetail
 *   `tokenrelay:done`: an answer ended (`toolCalls`: the calls it made, with `params.tools`)
 * @typedef {{code: string, message: string, source: "token"|"connection"|"server"|"stream",
 *   fatal: boolean}} ErrorDetail
 *   `tokenrelay:error`: something went wrong (docs/client.md); `fatal`: no retry follows
 */
