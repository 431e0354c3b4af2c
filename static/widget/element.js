// The <tokenrelay-chat> custom element (widget.js loads this module and calls defineChat):
// attributes and properties (docs/client.md "Widget"), one TokenRelayClient per endpoint with
// a token asked before every connect (the `token` property or `token-url`), errors shown and
// emitted as `tokenrelay:error`, the panel opened, closed and kept in step with the
// connection, its texts taken from the translatable table of widget/api.js (the `strings`
// attribute and property). The conversation is widget/conversation.js, the markup
// widget/view.js, the styles widget/styles.js, the token request widget/token.js: the modules
// are handed in by widget.js, which loads each of them with the same `?v=` as itself.

/**
 * Define <tokenrelay-chat> (once), from the modules widget.js loaded.
 * @param {{TokenRelayClient: typeof import("../tokenrelay-client.js").TokenRelayClient,
 *   renderMarkdown: (text: string) => Node, styleFor: (root: ShadowRoot) => void,
 *   fetchTokenFrom: (url: string) => Promise<string|null>, view: typeof import("./view.js"),
 *   withConversation: typeof import("./conversation.js").withConversation,
 *   api: typeof import("./api.js")}} modules
 */
export function defineChat(modules) {
  const { TokenRelayClient, renderMarkdown, styleFor, fetchTokenFrom, view, api } = modules;
  if (customElements.get("tokenrelay-chat")) return;
  const { buildView, applyTexts, messageNode } = view;
  const Base = modules.withConversation(HTMLElement, { renderMarkdown, messageNode });
  const STATE_TEXT = {
    idle: "stateIdle",
    connecting: "stateConnecting",
    open: "stateOpen",
    reconnecting: "stateReconnecting",
    offline: "stateOffline",
    closed: "stateClosed",
  };

  class TokenRelayChat extends Base {
    // system, temperature, max-tokens, seed and model are read at every send; theme and
    // position are pure CSS. These need work when they change:
    static get observedAttributes() {
      return ["chat-title", "open", "endpoint", "token-url", "greeting", "placeholder", "inline", "strings"];
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
      this._stringsProp = null; // the `strings` property, laid over the attribute's
      this._stringsAttr = undefined; // the `strings` attribute last parsed, and its table
      this._stringsFromAttr = null;
      this._strings = api.STRINGS;
      this._t = (key, values) => api.formatString(this._strings[key] ?? key, values);
      // properties set before this script defined the element
      for (const prop of ["token", "open", "strings"]) {
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

    /**
     * The texts the widget shows: the English table (widget/api.js STRINGS) with the
     * `strings` attribute (JSON) and then this property laid over it. Set an object of the
     * texts to change (null: none); reading gives the whole table in use.
     * @returns {Readonly<Record<string, string>>}
     */
    get strings() {
      return this._resolveStrings();
    }

    set strings(value) {
      if (value != null && typeof value !== "object") {
        throw new TypeError("tokenrelay-chat: strings must be an object of texts or null");
      }
      this._stringsProp = value ?? null;
      this._applyStrings();
    }

    /** The table in use (cached: the attribute is parsed again only when it changed). */
    _resolveStrings() {
      const raw = this.getAttribute("strings");
      if (raw !== this._stringsAttr) {
        this._stringsAttr = raw;
        this._stringsFromAttr = null;
        if (raw) {
          try {
            this._stringsFromAttr = JSON.parse(raw);
          } catch (err) {
            console.warn("tokenrelay-chat: the strings attribute is not JSON", err);
          }
        }
      }
      this._strings = api.resolveStrings(this._stringsFromAttr, this._stringsProp);
      return this._strings;
    }

    /** New texts (strings, chat-title, greeting or placeholder changed): shown at once. */
    _applyStrings() {
      this._resolveStrings();
      if (!this._built) return;
      applyTexts(this._view, this._t, {
        title: this._titleText(),
        greeting: this._greetingText(),
        placeholder: this._placeholderText(),
      });
      this._showState(this._client ? this._client.state : "idle");
      this._renderAll();
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
        this._connLabel.textContent = this._t("stateResumed");
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
          this._report(code, this._t("tokenFailed", { message: (err && err.message) || String(err) }), "token", false);
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
        this._alert.textContent = (fatal || source === "server") ? message : this._t("retrying", { message });
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
      if (["greeting", "placeholder", "chat-title", "strings"].includes(name)) this._applyStrings();
      if (name === "inline") this._sync();
      if (name === "open") {
        this._sync();
        if (this.open) this._client?.connect();
      }
    }

    // the attributes win over the table's texts
    _titleText() {
      return this.getAttribute("chat-title") || this._strings.title;
    }

    _greetingText() {
      return this.getAttribute("greeting") || this._strings.greeting;
    }

    _placeholderText() {
      return this.getAttribute("placeholder") || this._strings.placeholder;
    }

    _build() {
      this._built = true;
      styleFor(this._root);
      const v = buildView();
      this._view = v;
      this._resolveStrings();
      applyTexts(v, this._t, {
        title: this._titleText(),
        greeting: this._greetingText(),
        placeholder: this._placeholderText(),
      });
      this._launcher = v.launcher;
      this._title = v.title;
      this._connLabel = v.connLabel;
      this._conn = v.conn;
      this._alert = v.alert;
      this._list = v.list;
      this._empty = v.empty;
      this._input = v.input;
      this._send = v.send;
      this._stop = v.stop;
      this._panel = v.panel;
      this._connLabel.textContent = this._t("stateIdle"); // until there is a client
      const { close, form } = v;
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
        this._connLabel.textContent = loading
          ? this._t("stateLoading")
          : STATE_TEXT[state] ? this._t(STATE_TEXT[state]) : state;
      }
    }
  }

  customElements.define("tokenrelay-chat", TokenRelayChat);
}
