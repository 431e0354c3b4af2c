// Type declarations for the <tokenrelay-chat> widget: the element that static/widget.js (a
// classic script) defines, and `tokenrelay-client/widget` in the npm package, which is
// static/widget/api.js (the attribute names and the table of texts, English defaults).
// Checked against the JSDoc of static/widget/api.js by tests/web/test_js_package.py
// (tests/js/api-check.mjs). See docs/client.md, "Widget".
//
// Importing this module's types also types `document.querySelector("tokenrelay-chat")`:
//   import type {} from "tokenrelay-client/widget";

import type { TokenRelayClient } from "./tokenrelay-client.js";

/** Every attribute of <tokenrelay-chat>; each may change at any time. */
export declare const ATTRIBUTES: readonly [
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
];

export type TokenRelayChatAttribute = (typeof ATTRIBUTES)[number];

/**
 * The attributes as a template sets them (all strings; `open` and `inline` count by being
 * present):
 * - `endpoint`: the gateway (default: the page's origin);
 * - `token-url`: your backend's URL answering `{"token": "..."}` (gateways with API keys);
 * - `chat-title`, `greeting`, `placeholder`: texts (over `strings`' `title`, `greeting`,
 *   `placeholder`);
 * - `open`, `inline`, `position` (`bottom-left`), `theme` (`light`, `dark`, `auto`);
 * - `system`, `temperature`, `max-tokens`, `seed`: sent with every message;
 * - `model`: one of the gateway's `GET /v1/models` (default: the gateway's default model);
 * - `strings`: JSON of the texts to change (`WidgetStrings`).
 */
export type TokenRelayChatAttributes = { [K in TokenRelayChatAttribute]?: string };

/**
 * Every text the widget shows or gives assistive technology. `{name}` is filled in:
 * `{title}` with the chat's title, `{message}` and `{code}` with an error's.
 */
export interface WidgetStrings {
  /** the header and the dialog's name: "Chat" */
  title: string;
  /** the empty conversation */
  greeting: string;
  /** the message box */
  placeholder: string;
  /** the launcher's name: "Open chat: {title}" */
  openChat: string;
  closeChat: string;
  /** the message list's name */
  messages: string;
  /** the message box's label */
  messageLabel: string;
  send: string;
  stop: string;
  /** the footer */
  poweredBy: string;
  /** before a visitor's message, for screen readers */
  youSaid: string;
  /** before an answer, for screen readers */
  answer: string;
  /** under an answer the visitor stopped */
  stopped: string;
  /** under an answer that ended with finish reason `error` or `expired` */
  unfinished: string;
  /** under an answer that failed: "{message} ({code})" */
  answerError: string;
  /** the alert line while a connection or token problem is retried: "{message}. Retrying..." */
  retrying: string;
  /** a token-url or token function that failed: "Could not get a chat token: {message}" */
  tokenFailed: string;
  stateIdle: string;
  stateConnecting: string;
  stateOpen: string;
  stateReconnecting: string;
  stateOffline: string;
  stateClosed: string;
  /** connected, no engine worker ready yet */
  stateLoading: string;
  /** for 3 s after an answer resumed on a new connection */
  stateResumed: string;
  /** above a call's arguments while the model writes them: "Calling {name}..." */
  callingTool: string;
  /** above a call's arguments once the answer ended: "Called {name}" */
  calledTool: string;
}

/** The English texts. */
export declare const STRINGS: Readonly<WidgetStrings>;

/** STRINGS with `overrides` laid over it in order; keys it does not have are ignored. */
export declare function resolveStrings(
  ...overrides: (Partial<WidgetStrings> | Record<string, unknown> | null | undefined)[]
): Readonly<WidgetStrings>;

/** `template` with each `{name}` replaced by `values[name]`. */
export declare function formatString(
  template: string,
  values?: Record<string, string | number>,
): string;

/** `tokenrelay:send`: the visitor sent a message. */
export interface SendDetail {
  text: string;
}

/** `tokenrelay:done`: an answer ended. */
export interface DoneDetail {
  text: string;
  state: "done" | "cancelled" | "error";
  /** the calls the answer made (with `params.tools`; the `done` frame's, OpenAI's shape) */
  toolCalls?: {
    id: string;
    type: "function";
    function: { name: string; arguments: string };
  }[];
}

/** `tokenrelay:error`: something went wrong (docs/client.md, "Widget"). */
export interface ErrorDetail {
  code: string;
  message: string;
  source: "token" | "connection" | "server" | "stream";
  /** no retry follows on its own */
  fatal: boolean;
}

/** The widget's events: CustomEvents that bubble and leave its shadow root (composed). */
export interface TokenRelayChatEventMap extends HTMLElementEventMap {
  "tokenrelay:send": CustomEvent<SendDetail>;
  "tokenrelay:done": CustomEvent<DoneDetail>;
  "tokenrelay:error": CustomEvent<ErrorDetail>;
}

/** A token, or a function called before every connect returning one (or a promise of one). */
export type TokenSource = string | null | (() => string | null | Promise<string | null>);

/** The <tokenrelay-chat> element (`document.querySelector("tokenrelay-chat")`). */
export interface TokenRelayChatElement extends HTMLElement {
  /** its client, made on the first connect; a new one after an `endpoint` change */
  readonly client: TokenRelayClient | null;
  /**
   * Credentials for a gateway with API keys, instead of `token-url`; may be set before
   * widget.js has loaded. A rejection with `code: "unauthorized"` stops retrying.
   */
  token: TokenSource;
  /** the `open` attribute */
  open: boolean;
  /**
   * The texts: reading gives the whole table in use; setting lays the texts given over the
   * English ones and the `strings` attribute's (null: none), shown at once. May be set
   * before widget.js has loaded.
   */
  get strings(): Readonly<WidgetStrings>;
  set strings(value: Partial<WidgetStrings> | null);
  /**
   * More `generate` params for every answer (docs/protocol.md), e.g. `tools` and
   * `tool_choice`: the attributes' (`temperature`, `max-tokens`, `seed`) win. Read at every
   * send; may be set before widget.js has loaded.
   */
  params: Record<string, unknown> | null;
  /** send a message (what the Send button does); held while no engine worker is ready */
  send(text: string): void;
  /** stop the answer being streamed */
  stop(): void;
  addEventListener<K extends keyof TokenRelayChatEventMap>(
    type: K,
    listener: (this: TokenRelayChatElement, ev: TokenRelayChatEventMap[K]) => any,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(
    type: string,
    listener: EventListenerOrEventListenerObject,
    options?: boolean | AddEventListenerOptions,
  ): void;
  removeEventListener<K extends keyof TokenRelayChatEventMap>(
    type: K,
    listener: (this: TokenRelayChatElement, ev: TokenRelayChatEventMap[K]) => any,
    options?: boolean | EventListenerOptions,
  ): void;
  removeEventListener(
    type: string,
    listener: EventListenerOrEventListenerObject,
    options?: boolean | EventListenerOptions,
  ): void;
}

declare global {
  interface HTMLElementTagNameMap {
    "tokenrelay-chat": TokenRelayChatElement;
  }
}
