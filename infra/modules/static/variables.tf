variable "gpu_groups" {
  description = "GPU facts per inventory group, keyed by group name (e.g. a100_80g). Each group becomes a child of gpu_nodes carrying the sarv_gpu_* variables documented in inventory.example.ini, plus extra_vars (e.g. nvme_raid_devices) verbatim."
  type = map(object({
    gpu_model            = string
    gpu_count            = number
    gpu_memory_mib       = number
    gpu_interconnect     = optional(string, "pcie")
    gpus_per_pcie_switch = optional(number)
    numa_nodes           = optional(number)
    nic                  = optional(string)
    labels               = optional(map(string), {})
    extra_vars           = optional(map(string), {})
  }))
  default = {}

  validation {
    condition     = alltrue([for name in keys(var.gpu_groups) : can(regex("^[a-z][a-z0-9_]*$", name))])
    error_message = "gpu_groups keys are Ansible group names: lower case letters, digits and '_', starting with a letter."
  }
  validation {
    condition     = alltrue([for g in values(var.gpu_groups) : contains(["nvlink", "pcie"], g.gpu_interconnect)])
    error_message = "gpu_interconnect must be \"nvlink\" or \"pcie\"."
  }
  validation {
    condition = alltrue([for g in values(var.gpu_groups) :
      g.gpu_count >= 1 && g.gpu_count <= 64 && floor(g.gpu_count) == g.gpu_count
    ])
    error_message = "gpu_count must be a whole number between 1 and 64."
  }
  validation {
    condition     = alltrue([for g in values(var.gpu_groups) : g.gpu_memory_mib > 0 && floor(g.gpu_memory_mib) == g.gpu_memory_mib])
    error_message = "gpu_memory_mib must be a positive whole number of MiB (nvidia-smi memory.total)."
  }
  validation {
    condition     = alltrue([for g in values(var.gpu_groups) : trimspace(g.gpu_model) != "" && !startswith(g.gpu_model, "NVIDIA ")])
    error_message = "gpu_model is the product name as nvidia-smi prints it without the \"NVIDIA \" prefix, e.g. A100-SXM4-80GB."
  }
  validation {
    condition = alltrue(flatten([for g in values(var.gpu_groups) : [
      for k, v in g.labels : can(regex("^[A-Za-z0-9_.-]+$", k)) && can(regex("^[A-Za-z0-9_.-]*$", v))
    ]]))
    error_message = "labels keys and values may contain only letters, digits, '_', '.' and '-' (they are joined as k=v,k=v)."
  }
  validation {
    condition = alltrue(flatten([for g in values(var.gpu_groups) : [
      for k in keys(g.extra_vars) : can(regex("^[a-z_][a-z0-9_]*$", k)) && !startswith(k, "sarv_gpu")
    ]]))
    error_message = "extra_vars keys must be Ansible variable names and must not redefine the sarv_gpu_* facts."
  }
}

variable "hosts" {
  description = "Every server of the fleet. gpu_group names a key of gpu_groups (GPU node); roles places a host in the service groups redis, monitoring and controlplane. A host may be both."
  type = list(object({
    name      = string
    address   = string
    gpu_group = optional(string)
    roles     = optional(list(string), [])
    ssh_user  = optional(string)
    ssh_port  = optional(number)
  }))

  validation {
    condition     = length(var.hosts) > 0
    error_message = "hosts must list at least one server."
  }
  validation {
    condition     = length(distinct([for h in var.hosts : h.name])) == length(var.hosts)
    error_message = "host names must be unique."
  }
  validation {
    condition     = alltrue([for h in var.hosts : can(regex("^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$", h.name))])
    error_message = "host names must be DNS-label-like: lower case letters, digits, '-' and '.', at most 63 characters."
  }
  validation {
    condition     = alltrue([for h in var.hosts : trimspace(h.address) != "" && !strcontains(h.address, " ")])
    error_message = "every host needs an address (IP or DNS name) without spaces."
  }
  validation {
    condition = alltrue(flatten([for h in var.hosts : [
      for r in h.roles : contains(["redis", "monitoring", "controlplane"], r)
    ]]))
    error_message = "roles may only contain \"redis\", \"monitoring\" and \"controlplane\"."
  }
  validation {
    condition     = alltrue([for h in var.hosts : h.gpu_group != null || length(h.roles) > 0])
    error_message = "every host needs a gpu_group, at least one role, or both."
  }
  validation {
    condition     = alltrue([for h in var.hosts : h.gpu_group == null || contains(keys(var.gpu_groups), coalesce(h.gpu_group, "-"))])
    error_message = "every host's gpu_group must be a key of gpu_groups."
  }
  validation {
    condition     = alltrue([for h in var.hosts : h.ssh_port == null || (coalesce(h.ssh_port, 22) >= 1 && coalesce(h.ssh_port, 22) <= 65535)])
    error_message = "ssh_port must be between 1 and 65535."
  }
}

variable "ansible_user" {
  description = "Remote user Ansible and llmctl connect as (written to [all:vars]); null leaves it to the operator's SSH config."
  type        = string
  default     = null

  validation {
    condition     = var.ansible_user == null || can(regex("^[a-z_][a-z0-9_-]*$", coalesce(var.ansible_user, "x")))
    error_message = "ansible_user must be a POSIX user name."
  }
}

variable "gpu_nodes_vars" {
  description = "Extra [gpu_nodes:vars] lines (e.g. nvidia_driver_branch, cuda_version, nvme_raid_devices as a JSON list string). Never put secrets here: the inventory is written in clear text."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.gpu_nodes_vars) : can(regex("^[a-z_][a-z0-9_]*$", k))])
    error_message = "gpu_nodes_vars keys must be Ansible variable names (lower case, digits, '_')."
  }
}
