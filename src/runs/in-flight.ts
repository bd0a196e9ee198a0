/**
 * The runs in progress in this process, for a cancel to find by id (runs/invoke.ts).
 *
 * Every run is added and removed once, and a cancel looks one up now and then: the adds and removes are on
 * the run path, the lookups are not. So the ids and values sit in two arrays whose slots are reused (a
 * stack of free ones), and a lookup scans the ids. Adding costs a store, with no hashing of the id.
 * An object keyed by run id, which this replaced, internalized every new id string and added it to a
 * dictionary, about a microsecond a run (issue 15, bench/README.md); a Map never reuses a deleted entry's
 * slot, so its table is rebuilt every few dozen runs and each old table keeps the runs of its moment
 * alive (the reason it was not a Map before). The scan is bounded by the runs in progress at once.
 */
export class InFlightRuns<T> {
  private readonly ids: Array<string | undefined> = [];
  private readonly values: Array<T | undefined> = [];
  /** When each slot's run was added (to find the latest of one id). */
  private readonly added: number[] = [];
  private readonly free: number[] = [];
  private adds = 0;

  /** Adds a run; returns its slot, which `remove` takes. */
  add(id: string, value: T): number {
    const slot = this.free.length > 0 ? (this.free.pop() as number) : this.ids.length;
    this.ids[slot] = id;
    this.values[slot] = value;
    this.adds += 1;
    this.added[slot] = this.adds;
    return slot;
  }

  /** Removes the run `add` put in `slot` (once). */
  remove(slot: number): void {
    this.ids[slot] = undefined;
    this.values[slot] = undefined;
    this.free.push(slot);
  }

  /** The value of a run in progress by its id (the latest added, should an id be added twice). */
  find(id: string): T | undefined {
    let found = -1;
    for (let slot = this.ids.indexOf(id); slot >= 0; slot = this.ids.indexOf(id, slot + 1)) {
      if (found < 0 || (this.added[slot] as number) > (this.added[found] as number)) found = slot;
    }
    return found < 0 ? undefined : this.values[found];
  }

  /** The values of every run in progress (a copy: acting on one may remove it). */
  all(): T[] {
    return this.values.filter((v): v is T => v !== undefined);
  }

  /** Runs in progress. */
  get size(): number {
    return this.ids.length - this.free.length;
  }
}
