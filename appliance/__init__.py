"""The serving appliance. Layers, bottom up (docs/ARCHITECTURE.md): core/ -> npu (device plane, a sibling
package) -> engine/ -> front ends and tools (config/, serve/, modes/, sweep/, cli, client, offline)."""
