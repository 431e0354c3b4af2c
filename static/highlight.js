// Syntax highlighting for code blocks in answers: highlight.js (vendored, pinned: see
// static/vendor/VERSIONS) with a small set of common languages. Only fenced blocks that name
// one of these languages are highlighted (no guessing: auto-detection is slow and often
// wrong on short snippets). The HTML it returns is `<span class="hljs-...">` markup around
// escaped text; static/markdown.js sanitises it like everything else and keeps only the
// `hljs`, `hljs-*` and `language-*` classes.
import hljs from "./vendor/highlight.core.min.js";
import bash from "./vendor/highlight.bash.min.js";
import c from "./vendor/highlight.c.min.js";
import cpp from "./vendor/highlight.cpp.min.js";
import css from "./vendor/highlight.css.min.js";
import go from "./vendor/highlight.go.min.js";
import javascript from "./vendor/highlight.javascript.min.js";
import json from "./vendor/highlight.json.min.js";
import python from "./vendor/highlight.python.min.js";
import rust from "./vendor/highlight.rust.min.js";
import sql from "./vendor/highlight.sql.min.js";
import typescript from "./vendor/highlight.typescript.min.js";
import xml from "./vendor/highlight.xml.min.js";

/** @type {Record<string, (hljs: any) => object>} */
const LANGUAGES = { bash, c, cpp, css, go, javascript, json, python, rust, sql, typescript, xml };
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);
// ```shell usually holds plain commands (highlight.js's own `shell` is for sessions with prompts)
hljs.registerAliases(["shell"], { languageName: "bash" });

/** Longest code block we highlight (characters); longer ones stay plain, to keep streaming cheap. */
export const MAX_HIGHLIGHT_CHARS = 20_000;

/**
 * The languages (and aliases: `py`, `js`, `ts`, `sh`, `html`, `c++`, `golang`, `rs`...) that
 * `highlightCode` understands.
 * @returns {string[]}
 */
export function languages() {
  return hljs.listLanguages();
}

/**
 * Highlight one code block.
 * @param {string} code the block's text (not escaped)
 * @param {string} lang the language named after the opening fence
 * @returns {{html: string, language: string} | null} HTML (escaped text in `hljs-*` spans) and
 *   the canonical language name, or null when the language is unknown or the block too long
 */
export function highlightCode(code, lang) {
  const name = String(lang || "").toLowerCase();
  if (!name || code.length > MAX_HIGHLIGHT_CHARS) return null;
  const grammar = hljs.getLanguage(name);
  if (!grammar) return null;
  const language = Object.keys(LANGUAGES).find((k) => hljs.getLanguage(k) === grammar) ?? name;
  try {
    return { html: hljs.highlight(code, { language: name, ignoreIllegals: true }).value, language };
  } catch {
    return null;
  }
}
