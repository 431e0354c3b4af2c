// The <tokenrelay-chat> widget's styles (widget.js loads this module): a constructed
// stylesheet in the element's shadow root, themable with --tokenrelay-* custom properties, in
// a light and a dark theme. No inline style attribute anywhere, so a strict
// Content-Security-Policy needs no 'unsafe-inline' (docs/client.md).

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
.body .tool-call { color: var(--_muted); font-size: 12px; display: flex; flex-direction: column; gap: 2px; }
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

let sheet = null;
/** Give `root` (a shadow root) the widget's styles. @param {ShadowRoot} root */
export function styleFor(root) {
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
