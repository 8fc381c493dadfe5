/* "Copy" buttons (templates/gpus/_calendar.html): a button marked data-copy="<input id>" puts
 * that read-only input's value on the clipboard and says so in its own text for a moment.
 * Where the clipboard API is refused (plain http, an old browser) it selects the text, so
 * Ctrl+C / Cmd+C still works.
 */
(function () {
  "use strict";
  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-copy]");
    if (!button) return;
    const input = document.getElementById(button.dataset.copy);
    if (!input) return;
    const label = button.textContent;
    const said = function (text) {
      button.textContent = text;
      setTimeout(function () { button.textContent = label; }, 2000);
    };
    input.select();
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(input.value).then(
        function () { said("Copied"); },
        function () { said("Press Ctrl+C"); }
      );
    } else {
      said("Press Ctrl+C");
    }
  });
})();
