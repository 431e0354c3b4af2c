// tokenrelay chat widget: one <script> tag adds a floating chat bubble to any page.
//
//   <script src="https://gateway.example/static/widget.js"
//           data-endpoint="https://gateway.example" data-title="Ask us" async></script>
//
// It defines the custom element <tokenrelay-chat> (shadow DOM, themable with CSS custom
// properties such as --tokenrelay-accent, light and dark themes) and, when the script tag has
// data-endpoint, mounts one on the page. On a gateway with API keys it gets a short-lived
// token before every connect from the host site's backend (token-url) or a `token` function.
// It is a classic script so it works with plain `async` script tags: this loader reads the
// tag, then loads the ES modules next to it with import(), each with the tag's own `?v=` so a
// deploy never mixes old and new ones: the client (tokenrelay-client.js), the Markdown
// renderer (markdown.js) and the widget's own modules in widget/: element.js (the custom
// element), conversation.js (its messages, streams and rendering), view.js (its markup),
// styles.js (its constructed stylesheet) and token.js (token-url). They import nothing of
// each other: this loader hands them to defineChat().
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

  Promise.all([
    import(asset("tokenrelay-client.js")),
    import(asset("markdown.js")),
    import(asset("widget/element.js")),
    import(asset("widget/conversation.js")),
    import(asset("widget/view.js")),
    import(asset("widget/styles.js")),
    import(asset("widget/token.js")),
  ])
    .then(([clientModule, md, element, conversation, view, styles, token]) => {
      element.defineChat({
        TokenRelayClient: clientModule.TokenRelayClient,
        renderMarkdown: md.renderMarkdown,
        withConversation: conversation.withConversation,
        view,
        styleFor: styles.styleFor,
        fetchTokenFrom: token.fetchTokenFrom,
      });
      if (document.body) autoMount();
      else document.addEventListener("DOMContentLoaded", autoMount, { once: true });
    })
    .catch((err) => {
      console.warn("tokenrelay widget: could not load its modules", err);
    });
})();
