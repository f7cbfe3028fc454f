variable "name_prefix" {
  description = "Prefix of every resource name and of the host names in the inventory (e.g. sarv-prod)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,30}[a-z0-9]$", var.name_prefix))
    error_message = "name_prefix must be 2-32 characters of lower case letters, digits and '-', starting with a letter."
  }
}

variable "image_id" {
  description = "Glance image id for every instance (a Debian 12 or Ubuntu 22.04/24.04 image; the site playbook installs drivers)."
  type        = string

  validation {
    condition     = trimspace(var.image_id) != ""
    error_message = "image_id must name an existing image (openstack image list)."
  }
}

variable "create_network" {
  description = "Create a private network and subnet; false attaches instances to network_id/subnet_id instead."
  type        = bool
  default     = true
}

variable "network_id" {
  description = "Existing network to use when create_network is false."
  type        = string
  default     = null

  validation {
    condition     = var.create_network || var.network_id != null
    error_message = "network_id is required when create_network is false."
  }
}

variable "subnet_id" {
  description = "Existing subnet (of network_id) to use when create_network is false."
  type        = string
  default     = null

  validation {
    condition     = var.create_network || var.subnet_id != null
    error_message = "subnet_id is required when create_network is false."
  }
}

variable "subnet_cidr" {
  description = "CIDR of the private subnet created when create_network is true."
  type        = string
  default     = "10.20.0.0/24"

  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0))
    error_message = "subnet_cidr must be an IPv4 CIDR such as 10.20.0.0/24."
  }
}

variable "dns_nameservers" {
  description = "DNS servers handed out on the private subnet (the site's resolvers in an air-gapped cloud)."
  type        = list(string)
  default     = []
}

variable "create_router" {
  description = "Create a router from the private subnet to external_network_id (needed for floating IPs and for reaching package mirrors)."
  type        = bool
  default     = false

  validation {
    condition     = !var.create_router || var.external_network_id != null
    error_message = "create_router needs external_network_id."
  }
}

variable "external_network_id" {
  description = "External (provider) network for the router and the floating IPs."
  type        = string
  default     = null
}

variable "enable_floating_ips" {
  description = "Give each service node a floating IP from floating_ip_pool (the gateway and Grafana entry points)."
  type        = bool
  default     = false

  validation {
    condition     = !var.enable_floating_ips || var.floating_ip_pool != null
    error_message = "enable_floating_ips needs floating_ip_pool (the external network's name)."
  }
}

variable "floating_ip_pool" {
  description = "Name of the external network floating IPs are allocated from."
  type        = string
  default     = null
}

variable "inventory_address" {
  description = "Which address the inventory's ansible_host uses: private (operator inside the network or via a bastion) or floating (service nodes only; GPU nodes always use private)."
  type        = string
  default     = "private"

  validation {
    condition     = contains(["private", "floating"], var.inventory_address)
    error_message = "inventory_address must be \"private\" or \"floating\"."
  }
  validation {
    condition     = var.inventory_address == "private" || var.enable_floating_ips
    error_message = "inventory_address = \"floating\" needs enable_floating_ips = true."
  }
}

variable "admin_allowed_cidrs" {
  description = "CIDRs allowed to reach SSH (22) and Grafana (3000). Empty means only hosts inside the security group."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.admin_allowed_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "admin_allowed_cidrs must be CIDRs and must not be 0.0.0.0/0 (SSH and Grafana are never open to everyone)."
  }
}

variable "api_allowed_cidrs" {
  description = "CIDRs allowed to reach the gateway's OpenAI-compatible API on gateway_port."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.api_allowed_cidrs : can(cidrhost(c, 0))])
    error_message = "api_allowed_cidrs must be CIDRs such as 10.0.0.0/8."
  }
}

variable "gateway_port" {
  description = "TCP port of the Sarv gateway on the controlplane node."
  type        = number
  default     = 8080

  validation {
    condition     = var.gateway_port >= 1 && var.gateway_port <= 65535
    error_message = "gateway_port must be between 1 and 65535."
  }
}

variable "create_keypair" {
  description = "Upload public_key as a new Nova keypair; false uses the existing keypair_name."
  type        = bool
  default     = false

  validation {
    condition     = !var.create_keypair || var.public_key != null
    error_message = "create_keypair needs public_key."
  }
}

variable "public_key" {
  description = "OpenSSH public key uploaded when create_keypair is true (a public key, never a private one)."
  type        = string
  default     = null

  validation {
    condition     = var.public_key == null || can(regex("^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp[0-9]+) ", coalesce(var.public_key, "-")))
    error_message = "public_key must be an OpenSSH public key line (ssh-ed25519 AAAA…)."
  }
}

variable "keypair_name" {
  description = "Existing Nova keypair injected into every instance when create_keypair is false."
  type        = string
  default     = null

  validation {
    condition     = var.create_keypair || var.keypair_name != null
    error_message = "keypair_name is required unless create_keypair is true."
  }
}

variable "gpu_pools" {
  description = "GPU node pools keyed by inventory group name: flavour, count, the GPU facts for the inventory and where the model cache lives (local NVMe devices of the flavour, or a Cinder volume per node)."
  type = map(object({
    flavor_name          = string
    count                = number
    gpu_model            = string
    gpu_count            = number
    gpu_memory_mib       = number
    gpu_interconnect     = optional(string, "pcie")
    gpus_per_pcie_switch = optional(number)
    numa_nodes           = optional(number)
    nic                  = optional(string)
    labels               = optional(map(string), {})
    availability_zone    = optional(string)
    root_volume_size_gb  = optional(number)
    model_cache = optional(object({
      kind           = optional(string, "local")
      local_devices  = optional(list(string), ["/dev/nvme0n1"])
      volume_size_gb = optional(number, 1024)
      volume_type    = optional(string)
    }), {})
  }))

  validation {
    condition     = length(var.gpu_pools) > 0
    error_message = "gpu_pools must define at least one pool."
  }
  validation {
    condition     = alltrue([for name in keys(var.gpu_pools) : can(regex("^[a-z][a-z0-9_]*$", name))])
    error_message = "gpu_pools keys are Ansible group names: lower case letters, digits and '_', starting with a letter."
  }
  validation {
    condition     = alltrue([for p in values(var.gpu_pools) : p.count >= 0 && p.count <= 256 && floor(p.count) == p.count])
    error_message = "count must be a whole number between 0 and 256."
  }
  validation {
    condition     = alltrue([for p in values(var.gpu_pools) : contains(["local", "volume"], p.model_cache.kind)])
    error_message = "model_cache.kind must be \"local\" (the flavour's NVMe) or \"volume\" (a Cinder volume per node)."
  }
  validation {
    condition     = alltrue([for p in values(var.gpu_pools) : p.model_cache.volume_size_gb >= 10])
    error_message = "model_cache.volume_size_gb must be at least 10 (weights of even a small model need several GiB)."
  }
  validation {
    condition     = alltrue([for p in values(var.gpu_pools) : p.root_volume_size_gb == null || coalesce(p.root_volume_size_gb, 0) >= 20])
    error_message = "root_volume_size_gb must be at least 20 (drivers, CUDA and container images), or null to boot from the flavour's disk."
  }
}

variable "service_flavor_name" {
  description = "Flavour of the service nodes (Redis, Prometheus/Grafana, controller and gateway)."
  type        = string
}

variable "service_count" {
  description = "Number of service nodes: all run Redis (3 or more for a Redis Cluster), the first also runs monitoring and the control plane."
  type        = number
  default     = 3

  validation {
    condition     = var.service_count >= 1 && var.service_count <= 16 && floor(var.service_count) == var.service_count
    error_message = "service_count must be a whole number between 1 and 16."
  }
}

variable "ansible_user" {
  description = "Login user of the image (debian, ubuntu …), written to the inventory's [all:vars]."
  type        = string
  default     = "debian"
}

variable "gpu_nodes_vars" {
  description = "Extra [gpu_nodes:vars] (nvidia_driver_branch, cuda_version …). No secrets: the inventory is clear text."
  type        = map(string)
  default     = {}
}

variable "metadata" {
  description = "Nova metadata added to every instance (owner, cost centre …)."
  type        = map(string)
  default     = {}
}
