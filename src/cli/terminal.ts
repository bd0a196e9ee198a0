/**
 * Text from functions (their logs, results, error messages, build output) reaches the user's terminal
 * through the CLI: a function must not be able to drive that terminal (clear it, set its title, write the
 * clipboard with OSC 52, hide text, move the cursor over earlier lines, reorder text with bidi controls).
 * Every CLI printer passes what it prints through `safeText` (plain text) or `safeJson` (JSON text).
 */

/**
 * C0 controls but `\n` and `\t`, DEL, C1 controls (U+0080-U+009F: CSI, OSC... as single code points), and
 * the Unicode controls that reorder or hide text (bidi embeddings, overrides and isolates, LRM/RLM/ALM,
 * line and paragraph separators).
 */
// biome-ignore lint/suspicious/noControlCharactersInRegex: matching control characters is the point
const UNSAFE = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]/g;

/** Same set but C0 (which JSON.stringify escapes already, and which JSON text never holds raw). */
const UNSAFE_IN_JSON = /[\u007f-\u009f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]/g;

function visible(ch: string): string {
  const code = ch.charCodeAt(0);
  // Caret notation, as `cat -v` and `less` show them: ESC is `^[`, BEL `^G`, CR `^M`, DEL `^?`.
  if (code < 0x20) return `^${String.fromCharCode(code + 0x40)}`;
  if (code === 0x7f) return '^?';
  return `<U+${code.toString(16).toUpperCase().padStart(4, '0')}>`;
}

/** `text` with every terminal control but newline and tab made visible (`\x1b` becomes `^[`). */
export function safeText(text: string): string {
  return text.replace(UNSAFE, visible);
}

/**
 * JSON text as `JSON.stringify` makes it, with the controls it leaves raw (C1, bidi) written as `\uXXXX`:
 * the same JSON value, safe to print. They can only be inside strings there, where the escape is valid.
 */
export function safeJson(json: string): string {
  return json.replace(UNSAFE_IN_JSON, (ch) => `\\u${ch.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

/** Writes `text` and a newline to stdout (or `stream`), controls made visible. */
export function printLine(text: string, stream: NodeJS.WriteStream = process.stdout): void {
  stream.write(`${safeText(text)}\n`);
}
