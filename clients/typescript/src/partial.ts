/**
 * Partial JSON: the value a growing JSON text holds so far. Open strings, arrays and objects are
 * closed; a trailing piece that cannot stand yet (a key without its value, `tru`, `-`, a
 * dangling `,` or `:`) is dropped. Used by `EspalierClient.streamJson`.
 */

const MAX_TRIM = 256;

/** `text` with its open string and containers closed (no check that the result parses). */
export function closeJson(text: string): string {
  const stack: string[] = [];
  let inString = false;
  let escaped = false;
  for (const ch of text) {
    if (inString) {
      if (escaped) escaped = false;
      else if (ch === "\\") escaped = true;
      else if (ch === '"') inString = false;
    } else if (ch === '"') inString = true;
    else if (ch === "{") stack.push("}");
    else if (ch === "[") stack.push("]");
    else if (ch === "}" || ch === "]") stack.pop();
  }
  let out = text;
  if (inString) out = (escaped ? out.slice(0, -1) : out) + '"';
  return out + stack.reverse().join("");
}

/** The value of the longest prefix of `text` that parses once closed; undefined if none. */
export function parsePartialJson(text: string): unknown {
  let end = text.length;
  for (let trims = 0; end > 0 && trims <= MAX_TRIM; trims++, end--) {
    const head = text.slice(0, end).replace(/[\s,:]+$/, "");
    if (!head) return undefined;
    try {
      return JSON.parse(closeJson(head));
    } catch {
      // drop one more character: a partial key, literal or number
    }
  }
  return undefined;
}

/** Feed text deltas; `feed` returns the value so far when it changed, else undefined. */
export class PartialJson {
  text = "";
  private last = "";

  feed(delta: string): unknown {
    this.text += delta;
    const value = parsePartialJson(this.text);
    if (value === undefined) return undefined;
    const key = JSON.stringify(value);
    if (key === this.last) return undefined;
    this.last = key;
    return value;
  }
}
