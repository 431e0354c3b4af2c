// Safe Markdown for model output: marked (vendored) renders, raw HTML in the text is shown as
// text, then DOMPurify (vendored) sanitises what marked produced. The result is a
// DocumentFragment: nothing the model writes is ever parsed as HTML by us.
//
// Trusted Types: on a page that enforces them (`require-trusted-types-for 'script'`), the
// only HTML string that reaches a sink is marked's output on its way into DOMPurify, which
// parses it into an inert document and sanitises it. It goes through one policy of ours,
// `tokenrelay-widget` (created on first use, kept private to this module), so DOMPurify
// creates none of its own; a page that lists its allowed policies (`trusted-types ...`)
// names that one.
//
// Code blocks may be syntax-highlighted (static/highlight.js, passed in by the caller so the
// widget does not load it): the highlighter's markup goes through the same sanitiser, which
// keeps a `class` attribute only on <code> and <span> and only its `hljs`, `hljs-*` and
// `language-*` names; every other class, every style and every handler is removed.
import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.js";

/** @param {string} s */
export function escapeHtml(s) {
  return String(s).replace(
    /[&<>"']/g,
    (c) => /** @type {Record<string,string>} */ ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c],
  );
}

/**
 * A code highlighter: HTML for the block (escaped text in `hljs-*` spans) and the language's
 * canonical name, or null to leave the block plain.
 * @typedef {(code: string, lang: string) => ({html: string, language: string} | null)} Highlighter
 */

/** The language label a fence may carry (```python title="x" gives `python`). */
const LANG = /^[A-Za-z0-9_+#.-]{1,32}$/;

/** The highlighter of the `renderMarkdown` call in progress (parsing is synchronous). */
/** @type {Highlighter | null} */
let activeHighlighter = null;

const marked = new Marked({
  gfm: true,
  breaks: false,
  async: false,
  renderer: {
    // Fenced and indented code: the language as a data attribute (for the label), and the
    // highlighter's markup when one is given and knows the language.
    code(/** @type {{text: string, lang?: string, escaped?: boolean}} */ token) {
      const first = (token.lang ?? "").match(/^\S*/)?.[0] ?? "";
      const lang = LANG.test(first) ? first : "";
      const text = token.text ? token.text.replace(/\n$/, "") + "\n" : "";
      const lit = lang && activeHighlighter ? activeHighlighter(text, lang) : null;
      const attrs = lang ? ` data-lang="${escapeHtml(lang)}"` : "";
      if (lit) {
        const cls = `hljs language-${lit.language.replace(/[^A-Za-z0-9_+#.-]/g, "")}`;
        return `<pre><code class="${cls}"${attrs}>${lit.html}</code></pre>\n`;
      }
      return `<pre><code${attrs}>${escapeHtml(text)}</code></pre>\n`;
    },
    // Raw HTML written by the model (or the user) is text, never markup.
    html(/** @type {{text: string, block?: boolean}} */ token) {
      const text = escapeHtml(token.text);
      return token.block ? `<p data-raw="html">${text}</p>` : text;
    },
    // No remote images (tracking pixels); show a link instead.
    image(/** @type {{href: string, text: string}} */ token) {
      return `<a href="${escapeHtml(token.href)}">${escapeHtml(token.text || token.href)}</a>`;
    },
  },
});

const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ["style", "img", "form", "input", "button", "textarea", "select", "option",
    "iframe", "frame", "object", "embed", "video", "audio", "source", "picture", "svg", "math",
    "link", "meta", "base"],
  FORBID_ATTR: ["style", "id", "name", "srcset", "action", "formaction"],
  ALLOW_DATA_ATTR: false,
  RETURN_DOM_FRAGMENT: true,
};

/** The only class names that survive sanitising: the highlighter's. */
const ALLOWED_CLASS = /^(?:hljs|hljs-[a-z0-9_-]{1,40}|language-[A-Za-z0-9_+#.-]{1,32})$/;
/** The only elements that may keep a class attribute. */
const CLASS_TAGS = new Set(["CODE", "SPAN"]);

/**
 * The class names of `value` that may stay ("" when none).
 * @param {string} value
 */
export function allowedClasses(value) {
  return String(value)
    .split(/\s+/)
    .filter((c) => ALLOWED_CLASS.test(c))
    .join(" ");
}

/** The name of our Trusted Types policy (allow it in a page's `trusted-types` list). */
export const TRUSTED_TYPES_POLICY = "tokenrelay-widget";

/** @type {{createHTML: (s: string) => any, createScriptURL: (s: string) => any} | null | undefined} */
let policy; // undefined: not asked yet; null: no Trusted Types here (or the page refused it)

/** Our policy, created once, where the browser has Trusted Types. */
function trustedTypesPolicy() {
  if (policy !== undefined) return policy;
  policy = null;
  const tt = /** @type {any} */ (globalThis).trustedTypes;
  if (tt && typeof tt.createPolicy === "function") {
    try {
      policy = tt.createPolicy(TRUSTED_TYPES_POLICY, {
        // only ever called by DOMPurify, on the markup it is about to parse inertly and clean
        createHTML: (/** @type {string} */ html) => html,
        // no script URL survives our sanitiser (scripts, frames, objects are all forbidden)
        createScriptURL: () => "",
      });
    } catch (err) {
      console.warn(`tokenrelay: Trusted Types policy ${TRUSTED_TYPES_POLICY} refused`, err);
    }
  }
  return policy;
}

let hooked = false;
function hook() {
  if (hooked) return;
  hooked = true;
  DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
    if (data.attrName !== "class") return;
    const kept = CLASS_TAGS.has(node.nodeName) ? allowedClasses(data.attrValue) : "";
    if (kept) data.attrValue = kept;
    else data.keepAttr = false;
  });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.getAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  });
}

/**
 * Sanitise HTML into a DocumentFragment with the rules above (exported for the tests, which
 * feed it hostile markup directly: model text never reaches it as HTML).
 * @param {string} html
 * @returns {DocumentFragment}
 */
export function sanitize(html) {
  hook();
  const tt = trustedTypesPolicy();
  const config = { ...PURIFY, ADD_ATTR: ["data-lang", "data-raw", "target"] };
  return /** @type {DocumentFragment} */ (
    /** @type {unknown} */ (DOMPurify.sanitize(html, tt ? { ...config, TRUSTED_TYPES_POLICY: tt } : config))
  );
}

/**
 * Markdown source to a sanitised DocumentFragment.
 * @param {string} source
 * @param {{highlight?: Highlighter | null}} [options] `highlight`: syntax-highlight code blocks
 *   (static/highlight.js `highlightCode`)
 * @returns {DocumentFragment}
 */
export function renderMarkdown(source, options = {}) {
  activeHighlighter = options.highlight ?? null;
  let html;
  try {
    html = /** @type {string} */ (marked.parse(source ?? ""));
  } finally {
    activeHighlighter = null;
  }
  return sanitize(html);
}

/**
 * Add a "Copy" button to each code block of a rendered answer.
 * @param {ParentNode} root
 * @param {(text: string) => Promise<boolean>} copy
 */
export function decorateCodeBlocks(root, copy) {
  for (const pre of root.querySelectorAll("pre")) {
    if (pre.parentElement?.classList.contains("code-block")) continue;
    const code = pre.querySelector("code");
    const wrap = document.createElement("div");
    wrap.className = "code-block";
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const lang = document.createElement("span");
    lang.className = "code-lang";
    lang.textContent = code?.getAttribute("data-lang") ?? "";
    const btn = document.createElement("button");
    btn.type = "button";
    btn.className = "code-copy";
    btn.dataset.testid = "copy-code";
    btn.textContent = "Copy code";
    btn.addEventListener("click", async () => {
      const ok = await copy(code?.textContent ?? pre.textContent ?? "");
      btn.textContent = ok ? "Copied" : "Copy failed";
      setTimeout(() => {
        btn.textContent = "Copy code";
      }, 1500);
    });
    bar.append(lang, btn);
    pre.replaceWith(wrap);
    wrap.append(bar, pre);
  }
}

/**
 * Copy text to the clipboard; falls back to a hidden textarea where the async API is refused.
 * @param {string} text
 * @returns {Promise<boolean>}
 */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const ta = document.createElement("textarea");
    ta.value = text;
    ta.setAttribute("readonly", "");
    ta.className = "visually-hidden";
    document.body.append(ta);
    ta.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch {
      ok = false;
    }
    ta.remove();
    return ok;
  }
}
