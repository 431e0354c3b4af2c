// The chat page's generation settings: the form under Settings, filled from the URL presets
// (rendered by the server, they win) or else from localStorage, and the `params` and system
// prompt of the next generate.

import { $ } from "./dom.js";
import { KEY, storage } from "./state.js";

const DEFAULT_SETTINGS = {
  temperature: 0.7,
  max_tokens: 256,
  top_p: 1,
  top_k: 0,
  seed: null,
  system: "",
};
const NUMERIC = ["temperature", "max_tokens", "top_p", "top_k", "seed"];

const presets = (() => {
  try {
    return JSON.parse($("presets")?.textContent || "{}") ?? {};
  } catch {
    return {};
  }
})();
const settingsForm = /** @type {HTMLFormElement} */ ($("settings-form"));

function readSettingsForm() {
  /** @type {Record<string, any>} */
  const out = {};
  for (const el of settingsForm.elements) {
    const input = /** @type {HTMLInputElement} */ (el);
    if (!input.name) continue;
    if (NUMERIC.includes(input.name)) {
      const v = input.value.trim() === "" ? null : Number(input.value);
      out[input.name] = v === null || Number.isFinite(v) ? v : null;
    } else out[input.name] = input.value;
  }
  return out;
}

/** Fill the form from localStorage (fields without a URL preset) and save every change. */
export function initSettings() {
  const stored = storage.get(KEY.settings, {}) ?? {};
  for (const el of settingsForm.elements) {
    const input = /** @type {HTMLInputElement} */ (el);
    if (!input.name || input.name in presets) continue; // URL presets win (already rendered)
    const v = stored[input.name];
    input.value = v == null ? "" : String(v);
  }
  settingsForm.addEventListener("input", () => storage.set(KEY.settings, readSettingsForm()));
  settingsForm.addEventListener("submit", (e) => e.preventDefault());
}

/** The params of a generate frame from the settings (blank fields use the defaults). */
export function generationParams() {
  const s = readSettingsForm();
  /** @type {Record<string, number>} */
  const params = {};
  const num = (name) => (s[name] ?? DEFAULT_SETTINGS[name]);
  params.temperature = Math.max(0, num("temperature"));
  params.max_tokens = Math.max(1, Math.round(num("max_tokens")));
  const topP = num("top_p");
  if (topP > 0 && topP <= 1) params.top_p = topP;
  const topK = num("top_k");
  if (topK > 0) params.top_k = Math.round(topK);
  if (s.seed != null) params.seed = Math.round(s.seed);
  return { params, system: (s.system ?? "").trim() };
}

/** Show or hide the settings panel (the header's Settings button). */
export function toggleSettings() {
  const settingsBtn = $("toggle-settings");
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  settingsBtn.setAttribute("aria-expanded", String(!panel.hidden));
  if (!panel.hidden) /** @type {HTMLElement|null} */ (panel.querySelector("input"))?.focus();
}
