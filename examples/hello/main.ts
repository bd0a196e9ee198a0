/**
 * A function Ferry can run. Every exported function whose name does not start with `_` is callable at
 * POST /v4/<project_id>/hello/<function>; the JSON body is its one argument.
 */
export interface RunInput {
  name?: string;
  greeting?: string;
}

export function run({ name = 'world', greeting = 'Hello' }: RunInput = {}): { message: string } {
  return { message: `${greeting}, ${name}!` };
}

/** Not callable from outside: the leading underscore keeps it private. */
export function _helper(): string {
  return 'private';
}
