// The conversation of a <tokenrelay-chat> widget (widget.js loads this module): its messages,
// kept in sessionStorage per endpoint together with the answer in flight (so a reload resumes
// it), send and stop, following a stream into its message, and rendering the list (the last
// message at most once a frame while it streams). A mixin of the element's class
// (widget/element.js): it uses the element's client, its view parts (`_list`, `_empty`,
// `_input`), its texts (`_t`), `_sync()` and `_report()`.

/**
 * The conversation methods over `Base` (HTMLElement).
 * @param {typeof HTMLElement} Base
 * @param {{renderMarkdown: (text: string) => Node,
 *   messageNode: (m: object, renderMarkdown: (text: string) => Node,
 *     t: (key: string, values?: object) => string) => Node}} render
 */
export function withConversation(Base, { renderMarkdown, messageNode }) {
  return class ChatConversation extends Base {
    /** sessionStorage key of this endpoint's conversation */
    get _storageKey() {
      return `tokenrelay.widget.v1:${this._endpoint()}`;
    }

    _params() {
      // the `params` property (tools, tool_choice...) under the attributes'
      const extra = this.params;
      const params = extra && typeof extra === "object" ? { ...extra } : {};
      const t = this.getAttribute("temperature");
      const m = this.getAttribute("max-tokens");
      const s = this.getAttribute("seed");
      if (t !== null && t !== "" && Number.isFinite(Number(t))) params.temperature = Number(t);
      if (m !== null && m !== "" && Number.isInteger(Number(m))) params.max_tokens = Number(m);
      if (s !== null && s !== "" && Number.isInteger(Number(s))) params.seed = Number(s);
      // the answer keeps generating while the page is away (a locked phone): 5 minutes, the
      // gateway's default when longer, its most when shorter (its hello says both)
      const hello = this._client?.hello ?? {};
      const most = Number(hello.max_detach_timeout) || Infinity;
      params.detach_timeout = Math.min(Math.max(300, Number(hello.detach_timeout) || 0), most);
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
        const { streamId, resumeToken, lastSeq: after, text, toolCalls } = rec;
        this._follow(this._client.resume({ streamId, resumeToken, after, text, toolCalls }), rec);
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
      const model = this.getAttribute("model"); // none: the gateway's default model
      const request = { messages: history, params: this._params() };
      const stream = this._client.generate(model ? { ...request, model } : request);
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
      // a call as the model writes it: shown with its arguments so far (widget/view.js)
      stream.addEventListener("tool-call", mine(() => {
        record.toolCalls = msg.toolCalls = structuredClone(stream.toolCalls);
        this._save();
        this._scheduleRender();
      }));
      // the note under a stopped or failed answer is worded when rendered (widget/view.js)
      const end = (state, error) => {
        msg.content = stream.text;
        msg.state = state;
        if (error) msg.error = error;
        // the done frame's calls (a call cut off is not among them); none when it failed
        const toolCalls = state === "error" ? [] : structuredClone(stream.toolCalls);
        if (toolCalls.length) msg.toolCalls = toolCalls;
        else delete msg.toolCalls;
        this._active = null;
        this._save();
        this._renderAll();
        this._sync();
        const detail = { text: msg.content, state, ...(toolCalls.length ? { toolCalls } : {}) };
        this.dispatchEvent(new CustomEvent("tokenrelay:done", { detail, bubbles: true, composed: true }));
      };
      stream.addEventListener("done", mine((e) => {
        const r = e.detail.finishReason;
        if (r === "cancelled") end("cancelled");
        else if (r === "error" || r === "expired") end("error");
        else end("done");
      }));
      stream.addEventListener("error", mine((e) => {
        end("error", { code: e.detail.code, message: e.detail.message });
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

    _renderAll() {
      this._list.replaceChildren();
      if (!this._messages.length) this._list.append(this._empty);
      for (const m of this._messages) this._list.append(messageNode(m, renderMarkdown, this._t));
      this._list.scrollTop = this._list.scrollHeight;
    }

    _renderLast() {
      const last = this._list.lastElementChild;
      const m = this._messages.at(-1);
      if (!last || !m) return;
      const stick = this._list.scrollHeight - this._list.scrollTop - this._list.clientHeight < 60;
      last.replaceWith(messageNode(m, renderMarkdown, this._t));
      if (stick) this._list.scrollTop = this._list.scrollHeight;
    }
  };
}
