// Safe Markdown for model output: marked (vendored) renders, raw HTML in the text is shown as
// text, then DOMPurify (vendored) sanitises what marked produced. The result is a
// DocumentFragment: nothing the model writes is ever parsed as HTML by us.
import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.js";

/** @param {string} s */
export function escapeHtml(s) {
  return String(s).replace(
    /[&<>"']/g,
    (c) => /** @type {Record<string,string>} */ ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c],
  );
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  async: false,
  renderer: {
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
  FORBID_ATTR: ["style", "id", "name", "class", "srcset", "action", "formaction"],
  ALLOW_DATA_ATTR: false,
  RETURN_DOM_FRAGMENT: true,
};

let hooked = false;
function hook() {
  if (hooked) return;
  hooked = true;
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.getAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  });
}

/**
 * Markdown source to a sanitised DocumentFragment.
 * @param {string} source
 * @returns {DocumentFragment}
 */
export function renderMarkdown(source) {
  hook();
  const html = /** @type {string} */ (marked.parse(source ?? ""));
  // marked only adds `language-xxx` classes on code blocks; keep that one as a data attribute
  // (class attributes are forbidden) so the UI can label code blocks.
  const withLang = html.replace(
    /<code class="language-([A-Za-z0-9_+#.-]{1,32})">/g,
    '<code data-lang="$1">',
  );
  return /** @type {DocumentFragment} */ (
    /** @type {unknown} */ (DOMPurify.sanitize(withLang, { ...PURIFY, ADD_ATTR: ["data-lang", "data-raw", "target"] }))
  );
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
