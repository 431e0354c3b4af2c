// The box that edits a user message in place (messages.js shows it): a form with the text,
// "Save and answer" and "Cancel". Enter saves, Shift+Enter adds a line, Esc cancels; what
// saving and cancelling do is the caller's.

import { button } from "./dom.js";

/**
 * @param {string} draft the text to start from
 * @param {{input: (text: string) => void, save: (text: string) => void, cancel: () => void}} on
 * @returns {HTMLFormElement}
 */
export function editorForm(draft, on) {
  const form = document.createElement("form");
  form.className = "editor";
  form.dataset.testid = "editor";
  const box = document.createElement("textarea");
  box.className = "editor-box";
  box.dataset.testid = "edit-box";
  box.rows = 3;
  box.setAttribute("aria-label", "Edit your message");
  box.value = draft;
  box.addEventListener("input", () => on.input(box.value));
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && !e.altKey && !e.ctrlKey && !e.metaKey) {
      e.preventDefault();
      form.requestSubmit();
    } else if (e.key === "Escape" && !e.shiftKey) {
      e.preventDefault();
      e.stopPropagation();
      on.cancel();
    }
  });
  const bar = document.createElement("div");
  bar.className = "editor-actions";
  const save = button({
    type: "submit",
    className: "btn btn-primary btn-compact",
    testid: "edit-save",
    text: "Save and answer",
    title: "Replace this message and answer it again (the messages after it are removed)",
  });
  const cancel = button({
    className: "btn btn-compact",
    testid: "edit-cancel",
    text: "Cancel",
    onClick: () => on.cancel(),
  });
  bar.append(save, cancel);
  form.append(box, bar);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    on.save(box.value);
  });
  return form;
}
