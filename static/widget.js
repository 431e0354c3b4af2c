// tokenrelay chat widget: one <script> tag adds a floating chat bubble to any page.
//
//   <script src="https://gateway.example/static/widget.js"
//           data-endpoint="https://gateway.example" data-title="Ask us" async></script>
//
// It defines the custom element <tokenrelay-chat> (shadow DOM, themable with CSS custom
// properties such as --tokenrelay-accent, light and dark themes) and, when the script tag has
// data-endpoint, mounts one on the page. On a gateway with API keys it gets a short-lived
// token before every connect from the host site's backend (token-url) or a `token` function. It is a classic script so it works with plain `async` script tags; it loads
// the client module (tokenrelay-client.js) and the Markdown renderer next to it with import().
// Options, theming and events: docs/client.md.
(() => {
  "use strict";

  const script =
    document.currentScript ||
    Array.from(document.querySelectorAll("script[src]")).find((s) =>
      /\/widget\.js(\?|$)/.test(s.getAttribute("src") || ""),
    );
  const scriptUrl = script ? new URL(script.getAttribute("src"), location.href) : new URL(location.href);
  const version = scriptUrl.searchParams.get("v");
  const asset = (name) => {
    const u = new URL(name, scriptUrl);
    if (version) u.searchParams.set("v", version);
    return u.href;
  };
  const config = script ? { ...script.dataset } : {};

  // The dark theme: theme="dark", or theme="auto" (the default) when the visitor's system
  // prefers dark. Colours come from --tokenrelay-dark-*; the accent is shared unless
  // --tokenrelay-dark-accent is set.
  const DARK = `
  --_accent: var(--tokenrelay-dark-accent, var(--tokenrelay-accent, #6366f1));
  --_accent-fg: var(--tokenrelay-dark-accent-fg, var(--tokenrelay-accent-fg, #ffffff));
  --_bg: var(--tokenrelay-dark-bg, #1c1c21);
  --_fg: var(--tokenrelay-dark-fg, #ececf1);
  --_muted: var(--tokenrelay-dark-muted, #a1a1aa);
  --_border: var(--tokenrelay-dark-border, #3a3a42);
  --_user-bg: var(--tokenrelay-dark-user-bg, #312e81);
  --_code-bg: var(--tokenrelay-dark-code-bg, #2a2a31);
  --_link: var(--tokenrelay-dark-link, #a5b4fc);
  --_warn: #fbbf24;
  --_alert-bg: #422006;
  --_alert-fg: #fde68a;
  color-scheme: dark;`;

  const CSS_TEXT = `
:host {
  --_accent: var(--tokenrelay-accent, #4f46e5);
  --_accent-fg: var(--tokenrelay-accent-fg, #ffffff);
  --_bg: var(--tokenrelay-bg, #ffffff);
  --_fg: var(--tokenrelay-fg, #1d1d22);
  --_muted: var(--tokenrelay-muted, #6b6b76);
  --_border: var(--tokenrelay-border, #e2e2e8);
  --_user-bg: var(--tokenrelay-user-bg, #eef0ff);
  --_code-bg: var(--tokenrelay-code-bg, #f3f3f6);
  --_link: var(--tokenrelay-link, var(--_accent));
  --_warn: #b45309;
  --_alert-bg: #fef3c7;
  --_alert-fg: #78350f;
  --_radius: var(--tokenrelay-radius, 16px);
  --_font: var(--tokenrelay-font, system-ui, -apple-system, "Segoe UI", Roboto, sans-serif);
  --_width: var(--tokenrelay-width, 380px);
  --_height: var(--tokenrelay-height, 560px);
  --_offset: var(--tokenrelay-offset, 20px);
  --_bubble: var(--tokenrelay-bubble-size, 56px);
  all: initial;
  position: fixed;
  right: var(--_offset);
  bottom: var(--_offset);
  z-index: var(--tokenrelay-z-index, 2147483000);
  font: 14px/1.5 var(--_font);
  color: var(--_fg);
  color-scheme: light;
}
:host([theme="dark"]) {${DARK}
}
@media (prefers-color-scheme: dark) {
  :host(:not([theme="light"])) {${DARK}
  }
}
:host([position="bottom-left"]) { right: auto; left: var(--_offset); }
:host([inline]) { position: static; display: block; }
* { box-sizing: border-box; }
[hidden] { display: none !important; }
button, textarea { font: inherit; color: inherit; }
:focus-visible { outline: 2px solid var(--_accent); outline-offset: 2px; }
.vh { position: absolute; width: 1px; height: 1px; overflow: hidden; clip: rect(0 0 0 0); white-space: nowrap; }
.launcher {
  width: var(--_bubble); height: var(--_bubble); border-radius: 50%; border: 0; cursor: pointer;
  background: var(--_accent); color: var(--_accent-fg); display: grid; place-items: center;
  box-shadow: 0 6px 20px rgb(0 0 0 / 0.25); margin-left: auto;
}
.launcher svg { width: 26px; height: 26px; }
:host([inline]) .launcher { display: none; }
.panel {
  position: absolute; right: 0; bottom: calc(var(--_bubble) + 12px);
  width: min(var(--_width), calc(100vw - 2 * var(--_offset)));
  height: min(var(--_height), calc(100vh - var(--_bubble) - 3 * var(--_offset)));
  display: flex; flex-direction: column; background: var(--_bg); color: var(--_fg);
  border: 1px solid var(--_border); border-radius: var(--_radius); overflow: hidden;
  box-shadow: 0 12px 40px rgb(0 0 0 / 0.22);
}
:host([position="bottom-left"]) .panel { right: auto; left: 0; }
:host([inline]) .panel { position: relative; bottom: auto; width: 100%; box-shadow: none; }
header { display: flex; align-items: center; gap: 8px; padding: 10px 12px; background: var(--_accent); color: var(--_accent-fg); }
header .title { font-weight: 600; flex: 1; min-width: 0; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.conn { display: inline-flex; align-items: center; gap: 5px; font-size: 12px; opacity: 0.9; white-space: nowrap; }
.conn .dot { width: 7px; height: 7px; border-radius: 50%; background: #cbd5e1; }
.conn[data-state="open"] .dot { background: #4ade80; }
.conn[data-state="connecting"] .dot, .conn[data-state="loading"] .dot,
.conn[data-state="reconnecting"] .dot { background: #fbbf24; }
.conn[data-state="offline"] .dot, .conn[data-state="closed"] .dot { background: #f87171; }
.close { background: none; border: 0; color: inherit; cursor: pointer; font-size: 20px; line-height: 1; width: 32px; height: 32px; border-radius: 8px; }
.close:hover { background: rgb(255 255 255 / 0.15); }
.alert { margin: 8px 10px 0; padding: 6px 10px; border-radius: 8px; font-size: 12px; background: var(--_alert-bg); color: var(--_alert-fg); overflow-wrap: anywhere; }
.messages { flex: 1; overflow-y: auto; padding: 12px; min-height: 0; }
.empty { color: var(--_muted); text-align: center; margin-top: 30%; padding: 0 16px; }
.msg { margin: 0 0 10px; display: flex; }
.msg[data-role="user"] { justify-content: flex-end; }
.msg .body { max-width: 88%; min-width: 0; overflow-wrap: anywhere; }
.msg[data-role="user"] .body { background: var(--_user-bg); padding: 7px 11px; border-radius: 14px 14px 4px 14px; white-space: pre-wrap; }
.msg[data-role="assistant"] .body { max-width: 100%; }
.msg[data-state="cancelled"] .note, .msg[data-state="error"] .note { color: var(--_warn); font-size: 12px; }
.body > :first-child { margin-top: 0; } .body > :last-child { margin-bottom: 0; }
.body p[data-raw] { white-space: pre-wrap; }
.body a { color: var(--_link); }
.body code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 0.9em; background: var(--_code-bg); padding: 0.1em 0.3em; border-radius: 4px; }
.body pre { background: var(--_code-bg); padding: 10px; border-radius: 8px; overflow-x: auto; }
.body pre code { background: none; padding: 0; }
.composer { display: flex; gap: 6px; padding: 10px; border-top: 1px solid var(--_border); align-items: flex-end; }
.composer textarea { flex: 1; resize: none; min-height: 40px; max-height: 120px; padding: 8px 10px; border: 1px solid var(--_border); border-radius: 10px; background: var(--_bg); }
.composer button { min-height: 40px; padding: 0 14px; border-radius: 10px; border: 0; cursor: pointer; font-weight: 600; background: var(--_accent); color: var(--_accent-fg); }
.composer button.stop { background: #c0262d; color: #fff; }
.foot { font-size: 11px; color: var(--_muted); text-align: center; padding: 0 0 6px; }
@media (max-width: 480px) {
  .panel { position: fixed; inset: auto 8px calc(var(--_bubble) + 2 * var(--_offset)) 8px; width: auto; height: min(var(--_height), 70vh); }
}
`;

  const CHAT_ICON =
    '<svg viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2" stroke-linecap="round" stroke-linejoin="round" aria-hidden="true"><path d="M21 15a2 2 0 0 1-2 2H7l-4 4V5a2 2 0 0 1 2-2h14a2 2 0 0 1 2 2z"/></svg>';
  const LABELS = {
    idle: "Offline",
    connecting: "Connecting...",
    open: "Online",
    reconnecting: "Reconnecting...",
    offline: "Offline",
    closed: "Disconnected",
  };

  let sheet = null;
  function styleFor(root) {
    if ("adoptedStyleSheets" in root && typeof CSSStyleSheet === "function") {
      try {
        if (!sheet) {
          sheet = new CSSStyleSheet();
          sheet.replaceSync(CSS_TEXT);
        }
        root.adoptedStyleSheets = [sheet];
        return;
      } catch {
        /* fall back to a <style> element */
      }
    }
    const style = document.createElement("style");
    style.textContent = CSS_TEXT;
    root.append(style);
  }

  function el(tag, attrs = {}, ...children) {
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
   * An Error carrying a protocol-style `code` (the client reads `code === "unauthorized"`).
   * @param {string} code @param {string} message
   */
  function codedError(code, message) {
    const err = new Error(message);
    /** @type {any} */ (err).code = code;
    return err;
  }

  /**
   * GET the host site's token endpoint (same-origin cookies included) and return its
   * `{"token": "..."}` (null: the gateway has no keys). Rejects with code `token_failed`.
   * @param {string} url
   * @returns {Promise<string|null>}
   */
  async function fetchTokenFrom(url) {
    let resp;
    try {
      resp = await fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } });
    } catch (err) {
      throw codedError("token_failed", `token-url: ${(err && err.message) || "network error"}`);
    }
    if (!resp.ok) throw codedError("token_failed", `token-url answered HTTP ${resp.status}`);
    let body = null;
    try {
      body = await resp.json();
    } catch {
      /* handled below */
    }
    if (!body || typeof body !== "object" || !(typeof body.token === "string" || body.token === null)) {
      throw codedError("token_failed", 'token-url must answer JSON {"token": "..."}');
    }
    return body.token;
  }

  function define(TokenRelayClient, md) {
    if (customElements.get("tokenrelay-chat")) return;

    class TokenRelayChat extends HTMLElement {
      // system, temperature, max-tokens and seed are read at every send; theme and position
      // are pure CSS. These need work when they change:
      static get observedAttributes() {
        return ["chat-title", "open", "endpoint", "token-url", "greeting", "placeholder", "inline"];
      }

      constructor() {
        super();
        this._root = this.attachShadow({ mode: "open" });
        this._client = null;
        this._messages = [];
        this._active = null;
        this._built = false;
        /** @type {string|null|(() => string|null|Promise<string|null>)} */
        this._tokenSource = null;
        this._greeted = false; // the current socket got `hello`
        this._refusal = null; // an error frame before `hello`: reported with the close
        // properties set before this script defined the element
        for (const prop of ["token", "open"]) {
          if (Object.prototype.hasOwnProperty.call(this, prop)) {
            const value = this[prop];
            delete this[prop];
            this[prop] = value;
          }
        }
      }

      /** The TokenRelayClient this widget uses (created on first connect; replaced when
       * `endpoint` changes). */
      get client() {
        return this._client;
      }

      /**
       * Credentials for a gateway with API keys, instead of `token-url`: a token from
       * `POST /v1/ws-token`, or a function returning one (or a promise of one), called before
       * every connect and reconnect. A rejection with `code: "unauthorized"` stops retrying.
       * @returns {string|null|(() => string|null|Promise<string|null>)}
       */
      get token() {
        return this._tokenSource;
      }

      set token(value) {
        if (value != null && typeof value !== "function" && typeof value !== "string") {
          throw new TypeError("tokenrelay-chat: token must be a string, a function or null");
        }
        if (value === this._tokenSource) return;
        this._tokenSource = value ?? null;
        this._reconnect();
      }

      get open() {
        return this.hasAttribute("open");
      }

      set open(value) {
        this.toggleAttribute("open", !!value);
      }

      get _storageKey() {
        return `tokenrelay.widget.v1:${this._endpoint()}`;
      }

      _endpoint() {
        return this.getAttribute("endpoint") || location.origin;
      }

      connectedCallback() {
        if (!this._built) this._build();
        if (!this._client) {
          this._makeClient();
          if (this._client) this._restore();
        }
        if (this.open) this._client?.connect();
        this._sync();
      }

      /** A client for the current endpoint; its token is asked for before every connect. */
      _makeClient() {
        let client;
        try {
          client = new TokenRelayClient({ endpoint: this._endpoint(), token: () => this._token() });
        } catch (err) {
          this._client = null;
          this._report("bad_endpoint", String((err && err.message) || err), "connection", true);
          return;
        }
        this._client = client;
        const mine = (f) => (e) => {
          if (this._client === client) f(e.detail);
        };
        client.addEventListener("state", mine((d) => this._onState(d)));
        client.addEventListener("readiness", mine(() => this._showState(client.state)));
        client.addEventListener("open", mine(() => {
          this._greeted = true;
          this._refusal = null;
          this._alert.hidden = true;
        }));
        client.addEventListener("error", mine((d) => {
          if (this._greeted) this._report(d.code, d.message, "server", false);
          else this._refusal = d; // the handshake was refused: reported with the close
        }));
        client.addEventListener("resumed", mine(() => {
          this._conn.dataset.resumed = "true";
          this._connLabel.textContent = "Resumed";
          clearTimeout(this._resumedTimer);
          this._resumedTimer = setTimeout(() => {
            delete this._conn.dataset.resumed;
            this._showState(client.state);
          }, 3000);
        }));
        this._showState(client.state);
      }

      /**
       * The client's token option: the `token` property, else `token-url`, else none.
       * @returns {Promise<string|null>}
       */
      async _token() {
        const source = this._tokenSource;
        const url = this.getAttribute("token-url");
        try {
          if (typeof source === "function") return (await source()) ?? null;
          if (source) return source;
          return url ? await fetchTokenFrom(url) : null;
        } catch (err) {
          const code = (err && err.code) || "token_failed";
          // unauthorized ends the client: reported once, with its close
          if (code !== "unauthorized") {
            this._report(code, `Could not get a chat token: ${(err && err.message) || err}`, "token", false);
          }
          throw err;
        }
      }

      /** @param {{state: string, code?: string, message?: string}} detail */
      _onState(detail) {
        if (detail.state !== "open") this._greeted = false;
        if (detail.state === "closed" && detail.code) {
          const why = this._refusal || detail; // the server's own words when it sent any
          this._refusal = null;
          this._report(why.code, why.message, "connection", true);
        }
        this._showState(detail.state);
      }

      /**
       * Show a problem and emit `tokenrelay:error` {code, message, source, fatal}. Stream
       * errors are shown on their answer; the others in the alert line until the next `hello`.
       * @param {string} code @param {string} message
       * @param {"token"|"connection"|"server"|"stream"} source
       * @param {boolean} fatal no retry follows on its own
       */
      _report(code, message, source, fatal) {
        if (this._built && source !== "stream") {
          this._alert.textContent = (fatal || source === "server") ? message : `${message}. Retrying...`;
          this._alert.dataset.code = code;
          this._alert.hidden = false;
        }
        const detail = { code, message, source, fatal };
        this.dispatchEvent(new CustomEvent("tokenrelay:error", { detail, bubbles: true, composed: true }));
      }

      /** New credentials: a client that is (or tried to be) connected starts over with them. */
      _reconnect() {
        const client = this._client;
        if (!client || client.state === "idle" || !this.isConnected) return;
        client.close(); // unfinished streams stay known and resume on the new socket
        client.connect();
      }

      /** Another gateway: its own conversation (kept per endpoint) and a new client. */
      _switchEndpoint() {
        const old = this._client;
        const wasUsed = !!old && old.state !== "idle";
        this._client = null;
        old?.close(); // an answer in flight there resumes if the endpoint comes back
        this._active = null;
        this._messages = [];
        this._greeted = false;
        this._refusal = null;
        this._alert.hidden = true;
        this._makeClient();
        if (this._client) this._restore();
        this._renderAll();
        this._sync();
        if (this._client && this.isConnected && (wasUsed || this.open)) this._client.connect();
      }

      disconnectedCallback() {
        // keep the stream alive across a DOM move; close when really gone
        queueMicrotask(() => {
          if (!this.isConnected && this._client) this._client.close();
        });
      }

      attributeChangedCallback(name, oldValue, newValue) {
        if (!this._built || oldValue === newValue) return;
        if (name === "endpoint") this._switchEndpoint();
        if (name === "token-url" && !this._tokenSource) this._reconnect();
        if (name === "greeting") this._empty.textContent = this._greetingText();
        if (name === "placeholder") this._input.placeholder = this._placeholderText();
        if (name === "inline") this._sync();
        if (name === "chat-title") {
          this._title.textContent = this._titleText();
          this._launcher.setAttribute("aria-label", `Open chat: ${this._titleText()}`);
          this._panel.setAttribute("aria-label", this._titleText());
        }
        if (name === "open") {
          this._sync();
          if (this.open) this._client?.connect();
        }
      }

      _titleText() {
        return this.getAttribute("chat-title") || "Chat";
      }

      _greetingText() {
        return this.getAttribute("greeting") || "Ask a question. Enter sends, Shift+Enter adds a line.";
      }

      _placeholderText() {
        return this.getAttribute("placeholder") || "Type a message...";
      }

      _build() {
        this._built = true;
        styleFor(this._root);
        const title = this._titleText();
        this._launcher = el("button", {
          type: "button",
          class: "launcher",
          part: "launcher",
          "aria-expanded": "false",
          "aria-controls": "panel",
          "aria-label": `Open chat: ${title}`,
          "data-testid": "widget-launcher",
        });
        this._launcher.innerHTML = CHAT_ICON; // constant markup, no user data
        this._title = el("span", { class: "title", text: title });
        this._connLabel = el("span", { class: "label", text: "Offline" });
        this._conn = el(
          "span",
          { class: "conn", "data-testid": "connection", "data-state": "idle", role: "status" },
          el("span", { class: "dot", "aria-hidden": "true" }),
          this._connLabel,
        );
        const close = el("button", {
          type: "button",
          class: "close",
          "aria-label": "Close chat",
          "data-testid": "widget-close",
          text: "\u00d7",
        });
        this._alert = el("p", { class: "alert", role: "alert", "data-testid": "widget-error", hidden: true });
        this._list = el("div", { class: "messages", "data-testid": "messages", "aria-label": "Messages" });
        this._empty = el("p", { class: "empty", text: this._greetingText() });
        this._list.append(this._empty);
        this._input = el("textarea", {
          id: "input",
          rows: "1",
          "data-testid": "composer",
          placeholder: this._placeholderText(),
          enterkeyhint: "send",
        });
        this._send = el("button", { type: "submit", "data-testid": "send", text: "Send" });
        this._stop = el("button", { type: "button", class: "stop", "data-testid": "stop", text: "Stop", hidden: true });
        const form = el(
          "form",
          { class: "composer" },
          el("label", { for: "input", class: "vh", text: "Message" }),
          this._input,
          this._send,
          this._stop,
        );
        this._panel = el(
          "section",
          { id: "panel", class: "panel", part: "panel", role: "dialog", "aria-label": title, "data-testid": "widget-panel", hidden: true },
          el("header", { part: "header" }, this._title, this._conn, close),
          this._alert,
          this._list,
          form,
          el("div", { class: "foot", text: "Powered by tokenrelay" }),
        );
        this._root.append(this._panel, this._launcher);

        this._launcher.addEventListener("click", () => {
          this.open = !this.open;
          if (this.open) this._input.focus();
        });
        close.addEventListener("click", () => {
          this.open = false;
          this._launcher.focus();
        });
        form.addEventListener("submit", (e) => {
          e.preventDefault();
          this.send(this._input.value);
        });
        this._input.addEventListener("keydown", (e) => {
          if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
            e.preventDefault();
            this.send(this._input.value);
          }
        });
        this._stop.addEventListener("click", () => this.stop());
        this._root.addEventListener("keydown", (e) => {
          if (e.key !== "Escape") return;
          if (this._active) this.stop();
          else if (this.open) {
            this.open = false;
            this._launcher.focus();
          }
        });
      }

      _sync() {
        if (!this._built) return;
        const open = this.open || this.hasAttribute("inline");
        this._panel.hidden = !open;
        this._launcher.setAttribute("aria-expanded", String(open));
        this._send.hidden = !!this._active;
        this._stop.hidden = !this._active;
      }

      _showState(state) {
        if (!this._built) return;
        // connected, but no engine worker ready yet: say so, and hold the send button
        const loading = state === "open" && !!this._client && !this._client.workerReady;
        this._conn.dataset.state = loading ? "loading" : state;
        this._send.disabled = loading;
        if (state !== "open") delete this._conn.dataset.resumed;
        if (this._conn.dataset.resumed !== "true") {
          this._connLabel.textContent = loading ? "Loading model..." : LABELS[state] || state;
        }
      }

      _params() {
        const params = {};
        const t = this.getAttribute("temperature");
        const m = this.getAttribute("max-tokens");
        const s = this.getAttribute("seed");
        if (t !== null && t !== "" && Number.isFinite(Number(t))) params.temperature = Number(t);
        if (m !== null && m !== "" && Number.isInteger(Number(m))) params.max_tokens = Number(m);
        if (s !== null && s !== "" && Number.isInteger(Number(s))) params.seed = Number(s);
        return params;
      }

      _save() {
        try {
          sessionStorage.setItem(
            this._storageKey,
            JSON.stringify({ messages: this._messages, inflight: this._active?.record ?? null }),
          );
        } catch {
          /* storage disabled */
        }
      }

      _restore() {
        let saved = null;
        try {
          saved = JSON.parse(sessionStorage.getItem(this._storageKey) || "null");
        } catch {
          saved = null;
        }
        if (!saved || !Array.isArray(saved.messages)) return;
        this._messages = saved.messages;
        const rec = saved.inflight;
        const last = this._messages.at(-1);
        if (rec?.streamId && rec.resumeToken && last?.role === "assistant") {
          last.content = rec.text;
          last.state = "streaming";
          this._follow(this._client.resume({ streamId: rec.streamId, resumeToken: rec.resumeToken, after: rec.lastSeq, text: rec.text }), rec);
        } else if (last?.state === "streaming") {
          last.state = "error";
        }
        this._renderAll();
      }

      /** Send a user message (also what the Send button does). */
      send(text) {
        text = String(text ?? "").trim();
        // held (the text stays in the box) until an engine worker is ready
        if (!text || this._active || !this._client || !this._client.workerReady) return;
        this._input.value = "";
        this._messages.push({ role: "user", content: text });
        const history = [];
        const system = this.getAttribute("system");
        if (system) history.push({ role: "system", content: system });
        for (const m of this._messages) {
          if (m.role === "assistant" && (m.state === "error" || !m.content)) continue;
          history.push({ role: m.role, content: m.content });
        }
        this._messages.push({ role: "assistant", content: "", state: "streaming" });
        const stream = this._client.generate({ messages: history, params: this._params() });
        this._follow(stream, { streamId: null, resumeToken: null, lastSeq: 0, text: "" });
        this._renderAll();
        this.dispatchEvent(new CustomEvent("tokenrelay:send", { detail: { text }, bubbles: true, composed: true }));
      }

      /** Stop the answer being streamed. */
      stop() {
        this._active?.stream.cancel();
      }

      _follow(stream, record) {
        this._active = { stream, record };
        const msg = this._messages.at(-1);
        const client = this._client;
        // after an endpoint switch, the old client's streams no longer touch this widget
        const mine = (f) => (e) => {
          if (this._client === client) f(e);
        };
        stream.addEventListener("started", mine((e) => {
          record.streamId = e.detail.streamId;
          record.resumeToken = e.detail.resumeToken;
          this._save();
        }));
        stream.addEventListener("token", mine((e) => {
          record.lastSeq = e.detail.seq;
          record.text = e.detail.fullText;
          msg.content = record.text;
          this._save();
          this._scheduleRender();
        }));
        const end = (state, note) => {
          msg.content = stream.text;
          msg.state = state;
          if (note) msg.note = note;
          this._active = null;
          this._save();
          this._renderAll();
          this._sync();
          this.dispatchEvent(new CustomEvent("tokenrelay:done", { detail: { text: msg.content, state }, bubbles: true, composed: true }));
        };
        stream.addEventListener("done", mine((e) => {
          const r = e.detail.finishReason;
          if (r === "cancelled") end("cancelled", "Stopped");
          else if (r === "error" || r === "expired") end("error", "The answer did not finish.");
          else end("done");
        }));
        stream.addEventListener("error", mine((e) => {
          end("error", `${e.detail.message} (${e.detail.code})`);
          this._report(e.detail.code, e.detail.message, "stream", true);
        }));
        this._sync();
        this._save();
      }

      _scheduleRender() {
        if (this._renderPending) return;
        this._renderPending = true;
        const flush = () => {
          if (!this._renderPending) return;
          this._renderPending = false;
          this._renderLast();
        };
        requestAnimationFrame(flush);
        setTimeout(flush, 100);
      }

      _messageNode(m) {
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
          body.append(md.renderMarkdown(m.content));
          if (m.note) body.append(el("p", { class: "note", text: m.note }));
        }
        return node;
      }

      _renderAll() {
        this._list.replaceChildren();
        if (!this._messages.length) this._list.append(this._empty);
        for (const m of this._messages) this._list.append(this._messageNode(m));
        this._list.scrollTop = this._list.scrollHeight;
      }

      _renderLast() {
        const last = this._list.lastElementChild;
        const m = this._messages.at(-1);
        if (!last || !m) return;
        const stick = this._list.scrollHeight - this._list.scrollTop - this._list.clientHeight < 60;
        last.replaceWith(this._messageNode(m));
        if (stick) this._list.scrollTop = this._list.scrollHeight;
      }
    }

    customElements.define("tokenrelay-chat", TokenRelayChat);
  }

  function autoMount() {
    if (!config.endpoint || config.autoMount === "false") return;
    if (document.querySelector("tokenrelay-chat")) return;
    const chat = document.createElement("tokenrelay-chat");
    chat.setAttribute("endpoint", config.endpoint);
    for (const [key, attr] of [
      ["title", "chat-title"],
      ["placeholder", "placeholder"],
      ["greeting", "greeting"],
      ["system", "system"],
      ["temperature", "temperature"],
      ["maxTokens", "max-tokens"],
      ["seed", "seed"],
      ["position", "position"],
      ["tokenUrl", "token-url"],
      ["theme", "theme"],
    ]) {
      if (config[key] != null) chat.setAttribute(attr, config[key]);
    }
    if (config.open === "true") chat.setAttribute("open", "");
    document.body.append(chat);
  }

  Promise.all([import(asset("tokenrelay-client.js")), import(asset("markdown.js"))])
    .then(([clientModule, md]) => {
      define(clientModule.TokenRelayClient, md);
      if (document.body) autoMount();
      else document.addEventListener("DOMContentLoaded", autoMount, { once: true });
    })
    .catch((err) => {
      console.warn("tokenrelay widget: could not load its modules", err);
    });
})();
