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
// styles.js (its constructed stylesheet), token.js (token-url) and api.js (its attribute
// names and its translatable texts). They import nothing of each other: this loader hands
// them to defineChat(). Nothing here or there turns a string into HTML or script, so the
// widget runs on pages that enforce Trusted Types (markdown.js has the one policy,
// `tokenrelay-widget`, for DOMPurify).
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

  // every attribute from its data-* option (data-max-tokens for max-tokens...; data-title
  // for chat-title); the boolean ones (open, inline) with "true"
  function autoMount(attributes) {
    if (!config.endpoint || config.autoMount === "false") return;
    if (document.querySelector("tokenrelay-chat")) return;
    const chat = document.createElement("tokenrelay-chat");
    for (const attr of attributes) {
      const key = attr === "chat-title" ? "title" : attr.replace(/-([a-z])/g, (_, c) => c.toUpperCase());
      const value = config[key];
      if (value == null) continue;
      if (attr === "open" || attr === "inline") {
        if (value === "true") chat.setAttribute(attr, "");
      } else chat.setAttribute(attr, value);
    }
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
    import(asset("widget/api.js")),
  ])
    .then(([clientModule, md, element, conversation, view, styles, token, api]) => {
      element.defineChat({
        TokenRelayClient: clientModule.TokenRelayClient,
        renderMarkdown: md.renderMarkdown,
        withConversation: conversation.withConversation,
        view,
        styleFor: styles.styleFor,
        fetchTokenFrom: token.fetchTokenFrom,
        api,
      });
      const mount = () => autoMount(api.ATTRIBUTES);
      if (document.body) mount();
      else document.addEventListener("DOMContentLoaded", mount, { once: true });
    })
    .catch((err) => {
      console.warn("tokenrelay widget: could not load its modules", err);
    });
})();
