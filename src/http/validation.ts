/**
 * Request validation beyond what Ajv does with the route schemas: readable messages for its errors, and the
 * numbers it lets through. Both end as `400 FERRY_VALIDATION`.
 */
import type { FastifyRequest, FastifySchemaValidationError } from 'fastify';
import { FerryError } from '../errors.js';

/** What a value is, for a validation message: `querystring/limit` reads as "limit (query parameter)". */
function where(dataVar: string, instancePath: string): string {
  const name = instancePath.replace(/^\//, '').replaceAll('/', '.');
  if (dataVar === 'body') return name ? `body member ${name}` : 'body';
  const kind = { querystring: 'query parameter', params: 'path parameter', headers: 'header' }[dataVar] ?? dataVar;
  return name ? `${kind} ${name}` : kind;
}

/**
 * Fastify's validation message, made readable: a union of literals (`state`) says "must be one of a, b, c"
 * once instead of one "must be equal to constant" per member, and the value is named by where it was sent.
 */
export function formatValidationErrors(errors: FastifySchemaValidationError[], dataVar: string): Error {
  const allowed = new Map<string, unknown[]>();
  for (const e of errors) {
    if (e.keyword === 'const') {
      const list = allowed.get(e.instancePath) ?? [];
      list.push((e.params as { allowedValue?: unknown }).allowedValue);
      allowed.set(e.instancePath, list);
    } else if (e.keyword === 'enum') {
      allowed.set(e.instancePath, [...((e.params as { allowedValues?: unknown[] }).allowedValues ?? [])]);
    }
  }
  const messages: string[] = [];
  const said = new Set<string>();
  for (const e of errors) {
    const at = where(dataVar, e.instancePath);
    const values = allowed.get(e.instancePath);
    let text: string;
    if (values && (e.keyword === 'const' || e.keyword === 'enum' || e.keyword === 'anyOf')) {
      text = `${at} must be one of ${values.map((v) => (typeof v === 'string' ? v : JSON.stringify(v))).join(', ')}`;
    } else if (e.keyword === 'additionalProperties') {
      text = `${at} has an unknown member ${(e.params as { additionalProperty?: string }).additionalProperty}`;
    } else if (e.keyword === 'required') {
      text = `${where(dataVar, `${e.instancePath}/${(e.params as { missingProperty?: string }).missingProperty}`)} is required`;
    } else {
      text = `${at} ${e.message ?? 'is not valid'}`;
    }
    if (!said.has(text)) messages.push(text);
    said.add(text);
  }
  return new Error(messages.join('; '));
}

/**
 * Ajv coerces the query string `Infinity` (or `1e309`, `-Infinity`) to a number and then skips `integer`,
 * `minimum` and `maximum`, which only judge finite numbers. Every number Ferry takes from a URL is finite:
 * refuse the rest as the schema would have.
 */
export function assertFiniteNumbers(request: FastifyRequest): void {
  for (const [dataVar, values] of [
    ['querystring', request.query],
    ['params', request.params],
  ] as const) {
    if (!values || typeof values !== 'object') continue;
    for (const [name, value] of Object.entries(values)) {
      const numbers = Array.isArray(value) ? value : [value];
      if (numbers.some((n) => typeof n === 'number' && !Number.isFinite(n))) {
        throw new FerryError(
          'FERRY_VALIDATION',
          `Invalid request: ${where(dataVar, `/${name}`)} must be a finite number`,
        );
      }
    }
  }
}
