export { SyncularServerStorage, type SyncularServerStorageOptions } from './storage.js';
export {
  StorageConstraintError,
  StorageQueryError,
  SyncError,
  type ErrorClasses,
  type StorageConstraintErrorClass,
  type StorageQueryErrorClass,
  type SyncErrorClass,
} from './errors.js';
export type { PoolClientLike, PoolLike, StorageSource } from './connection.js';
export type * from './types.js';
